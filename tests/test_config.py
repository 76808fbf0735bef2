from __future__ import annotations

import pytest

import shmask


def test_defaults_and_env_parsing():
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
    ("SHMASK_LOG_LEVEL", "LOUD", "DEBUG"),
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
