"""The one restricted-unpickling rule (dist_checkpointing.pickling): every unpickler of stored
bytes refuses any global outside its allow-list without importing or calling it."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from dist_checkpointing import CheckpointingException
from dist_checkpointing.pickling.blob_header import load_blob_pickle
from dist_checkpointing.pickling.restricted import loads_plain
from dist_checkpointing.pickling.safe_load import load_dcp_metadata, safe_torch_load
from dist_checkpointing.pickling.trusted import loads_trusted


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _hostile() -> bytes:
    return pickle.dumps({"x": _Boom()})


def _refused(load, tmp_path, monkeypatch) -> BaseException:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as info:
        load()
    assert not (tmp_path / "PWNED").exists(), "the pickle ran"
    return info.value


def test_plain_data_only(tmp_path, monkeypatch):
    value = {"a": [1, 2.5, "s", (None, True)], "dtype": torch.bfloat16, "cut": slice(1, 4)}
    assert loads_plain(pickle.dumps(value)) == value
    e = _refused(lambda: loads_plain(_hostile()), tmp_path, monkeypatch)
    assert isinstance(e, pickle.UnpicklingError) and "not plain data" in str(e)


def test_blob_header_only_plain_tensors(tmp_path, monkeypatch):
    e = _refused(lambda: load_blob_pickle(_hostile()), tmp_path, monkeypatch)
    assert isinstance(e, pickle.UnpicklingError) and "not a plain tensor" in str(e)


def test_dcp_metadata_allow_list(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(_hostile())
    e = _refused(lambda: load_dcp_metadata(ckpt, verify_checksum=False), tmp_path, monkeypatch)
    assert isinstance(e, CheckpointingException) and "posix.system" in str(e) and "allow-list" in str(e)


def test_torch_load_allow_list(tmp_path, monkeypatch):
    import io

    buf = io.BytesIO()
    torch.save({"x": _Boom()}, buf)
    e = _refused(lambda: safe_torch_load(buf.getvalue(), "hostile object"), tmp_path, monkeypatch)
    assert isinstance(e, CheckpointingException) and "hostile object" in str(e)


def test_trusted_channel_is_plain_pickle():
    assert loads_trusted(pickle.dumps({"rank": 3})) == {"rank": 3}
