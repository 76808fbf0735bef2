from __future__ import annotations

import logging
import pathlib
import re
import warnings

import pytest

import shmask
import shmask.config as config_module


def test_defaults_and_env_parsing(monkeypatch):
    monkeypatch.setattr(config_module, "_warned", set())
    with pytest.warns(config_module.RingSizeWarning, match="SHMASK_RING_MB=3 is rounded up to 4"):
        config = shmask.Config.from_env({"SHMASK_RING_MB": "3", "SHMASK_TRANSPORT": "INLINE",
                                         "SHMASK_LEASE_S": "2.5", "SHMASK_LOG_LEVEL": "debug",
                                         "SHMASK_GPU_DIRECT": "OFF"})
    assert config.transport == "inline" and config.lease_s == 2.5 and config.log_level == "DEBUG"
    assert config.gpu_direct == "off" and shmask.Config().gpu_direct == "auto"
    assert config.ring_capacity_bytes == 4 * 2**20  # rounded up to a power of two
    assert shmask.Config.from_env({}).ring_capacity_bytes == 2**30


@pytest.mark.parametrize("name,value,accepted", [
    ("SHMASK_TRANSPORT", "tcp", "shm, inline"),
    ("SHMASK_RING_MB", "0", "1 to"),
    ("SHMASK_RING_MB", "lots", "int"),
    ("SHMASK_FULL_WAIT_MS", "-1", "0 to 60000"),
    ("SHMASK_LEASE_S", "0", "0.001 to 86400"),
    ("SHMASK_MAX_TOKENS", "99999999", "1 to"),
    ("SHMASK_QUEUE_ROWS", "0", "1 to"),
    ("SHMASK_NAME_PREFIX", "a/b", "letters"),
    ("SHMASK_LOG_LEVEL", "LOUD", "CRITICAL"),
    ("SHMASK_GPU_DIRECT", "maybe", "auto, off"),
    ("SHMASK_GPU_DIRECT", "always", "auto, off"),
    ("SHMASK_JSON_THREADS", "0", "1 to 64"),
    ("SHMASK_JSON_THREADS", "many", "int"),
])
def test_bad_values_name_the_variable_and_range(name, value, accepted):
    with pytest.raises(shmask.ConfigError) as info:
        shmask.Config.from_env({name: value})
    assert name in str(info.value) and accepted in str(info.value)


def test_overrides_win_over_env():
    assert shmask.Config.from_env({"SHMASK_RING_MB": "8"}, ring_mb=2).ring_mb == 2


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees its unknown names reported anew (once per process otherwise)."""
    monkeypatch.setattr(config_module, "_warned", set())


def test_a_misspelt_variable_warns_once_naming_the_closest_setting(fresh_warnings):
    env = {"SHMASK_RINGMB": "64"}
    with pytest.warns(config_module.UnknownVariableWarning) as caught:
        config = shmask.Config.from_env(env)
    assert config.ring_mb == 1024  # ignored
    assert len(caught) == 1
    assert "SHMASK_RINGMB" in str(caught[0].message)
    assert "did you mean SHMASK_RING_MB?" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second report would raise here
        shmask.Config.from_env(env)
    with pytest.warns(config_module.UnknownVariableWarning, match="SHMASK_LEASE_S"):
        shmask.Config.from_env({"SHMASK_LEASE": "3"})
    with pytest.warns(config_module.UnknownVariableWarning, match="known: SHMASK_TRANSPORT"):
        shmask.Config.from_env({"SHMASK_QUUXQUUXQUUX": "1"})  # nothing close: the list


def test_variables_of_the_tests_and_benchmarks_never_warn(fresh_warnings):
    """Every SHMASK_ name the repository uses outside Config is known."""
    root = pathlib.Path(__file__).resolve().parents[1]
    used: set[str] = set()
    for folder in ("tests", "benchmarks", "examples", "shmask", "kernels"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "test_config.py" or path.name == "config.py":
                continue  # their misspellings are on purpose
            used.update(re.findall(r"\bSHMASK_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    used.update(re.findall(r"\bSHMASK_[A-Z0-9_]*[A-Z0-9]\b", (root / "Makefile").read_text()))
    used.discard("SHMASK_RESPONSE_JSON_TABLES_H")  # a C include guard
    assert {"SHMASK_FAULTS_FULL", "SHMASK_TEST_GPU"} <= used
    env = dict.fromkeys(used, "1") | {"SHMASK_TEST_ANYTHING": "1", "SHMASK_BENCH_X": "1"}
    env = {name: value for name, value in env.items()
           if name not in shmask.config.variable_names()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shmask.Config.from_env(env)


def test_an_empty_value_means_unset(fresh_warnings):
    names = shmask.config.variable_names()
    config = shmask.Config.from_env(dict.fromkeys(names, ""))
    assert config == shmask.Config()
    assert shmask.Config.from_env({"SHMASK_RING_MB": "  "}).ring_mb == 1024


@pytest.mark.parametrize("raw,expected", [
    ("on", True), ("ON", True), ("true", True), ("True", True), ("yes", True), ("1", True),
    ("off", False), ("OFF", False), ("false", False), ("No", False), ("0", False),
])
def test_booleans_accept_every_usual_spelling(raw, expected):
    assert shmask.config.parse_bool("SHMASK_X", raw) is expected
    assert shmask.Config.from_env({"SHMASK_GPU_DIRECT": raw}).gpu_direct == (
        "auto" if expected else "off")


def test_a_bad_boolean_names_the_variable_and_the_spellings():
    with pytest.raises(shmask.ConfigError, match=r"SHMASK_X='maybe'.*on.*off"):
        shmask.config.parse_bool("SHMASK_X", "maybe")


@pytest.mark.parametrize("raw,level", [
    ("critical", "CRITICAL"), ("CRITICAL", "CRITICAL"), ("fatal", "CRITICAL"),
    ("warn", "WARNING"), ("Warning", "WARNING"), ("error", "ERROR"), ("info", "INFO"),
    ("debug", "DEBUG"), ("notset", "NOTSET"),
])
def test_log_levels_as_python_logging_names_them(raw, level):
    config = shmask.Config.from_env({"SHMASK_LOG_LEVEL": raw})
    assert config.log_level == level
    assert logging.getLevelName(level) != f"Level {level}"  # a name logging knows
    logger = logging.getLogger("shmask")
    before = logger.level
    try:
        config.apply_log_level()
        assert logger.level == logging.getLevelName(level)
    finally:
        logger.setLevel(before)


# ------------------------------------------------ issue 33: every field's type at construction
@pytest.mark.parametrize(("field", "value", "accepted"), [
    ("ring_mb", 1.5, "integers 1 to 1048576"), ("max_tokens", 100.5, "integers 1 to 4194304"),
    ("queue_rows", 2.5, "integers 1 to 65536"), ("ring_mb", True, "integers"),
    ("json_threads", 2.0, "integers 1 to 64"), ("offload_threads", False, "integers 1 to 256"),
    ("lease_s", True, "numbers 0.001 to 86400"), ("full_wait_ms", "50", "numbers 0 to 60000"),
    ("json_simd", 1, "True or False"), ("json_simd", "off", "True or False"),
    ("transport", 1, "shm, inline"), ("name_prefix", 5, "letters, digits"),
    ("mask_format", None, "lists, arrays"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_it(field, value, accepted):
    """Item 10: Config(ring_mb=1.5) and the like failed later (AttributeError,
    "an integer is required"); each field's type is checked at construction,
    bools are not ints and ints are not bools."""
    with pytest.raises(shmask.ConfigError) as info:
        shmask.Config(**{field: value})
    message = str(info.value)
    assert f"SHMASK_{field.upper()}={value!r}" in message and f"Config.{field}" in message
    assert accepted in message
