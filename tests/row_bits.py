"""What a Rows result is, as exact bits: the tests that hold one result to
another (every path, an engine's dtypes) compare these (pytest puts tests/
on sys.path)."""

from __future__ import annotations

import torch


def bits(rows) -> dict:
    """Everything a row is, as exact bits (floats as their uint32 patterns);
    a sample's tokens are not a row's: compared apart."""
    def raw(t):
        t = t.cpu()
        return t.view(torch.int32).tolist() if t.dtype == torch.float32 else t.tolist()
    return {"status": raw(rows.status), "lengths": raw(rows.lengths), "forms": raw(rows.forms),
            "sizes": raw(rows.sizes), "offsets": raw(rows.offsets),
            "id_offsets": raw(rows.id_offsets),
            "ids": raw(rows.ids[:int(rows.id_offsets[-1])]),
            "values": raw(rows.values[:int(rows.offsets[-1])]),
            "selected": None if rows.selected_logprob is None else raw(rows.selected_logprob)}
