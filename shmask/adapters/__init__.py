"""Drop-in adapters that put shmask under the sampling-mask types of serving
engines, so an engine adopts shmask without rewriting the code that moves
and reads its masks.

Each adapter is its own module (``shmask.adapters.sglang``, ...) and imports
nothing from the engine: the engine imports the adapter, never the reverse.
Importing this package imports no adapter.
"""
