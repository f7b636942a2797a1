"""minfer's GGUF header reader against the gguf package's full reader, on the shipped model and on
small files written by the gguf package's writer; damaged files get errors that name the file."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from minfer.formats.gguf_file import dequantize, read_gguf_file
from minfer.lab.bench.common import best_time
from minfer.models.loader import load_model, resolve_model_path


def assert_same_as_gguf_reader(path: str) -> None:
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # their header, as fields
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        expected, value = field.contents(), ours.metadata[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
            assert value == len(expected), key  # arrays of strings: their length
        elif isinstance(value, np.ndarray):
            assert value.tolist() == list(expected), key
        else:
            assert value == expected and type(value) is type(expected), key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type == tensor.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert mine.data.tobytes() == np.asarray(tensor.data).tobytes(), tensor.name
        decoded = dequantize(mine)  # our whole-tensor decoding (F32, F16, Q4_1, Q8_0; the package's for others)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(mine.shape).astype(np.float32)
        assert decoded.dtype == np.float32 and decoded.flags.writeable, tensor.name
        assert decoded.tobytes() == expected.tobytes(), tensor.name  # bit for bit


def write_small_gguf(path, alignment: int = 32) -> dict[str, np.ndarray]:
    """Every kind of value and five tensor types (F32, F16, Q8_0, Q4_1, and Q5_0, which minfer leaves to the
    gguf package to decode); returns the float tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment != 32:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint32("t.u32", 70000)
    writer.add_int64("t.i64", -(2 ** 40))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.string", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.25, -1.5])
    writer.add_array("t.strings", ["a", "", "ccc" * 100])
    rng = np.random.default_rng(0)
    tensors = {"w.f32": rng.standard_normal((3, 5)).astype(np.float32),
               "w.f16": rng.standard_normal((2, 4, 8)).astype(np.float32),
               "w.q8_0": rng.standard_normal((4, 64)).astype(np.float32),
               "w.q4_1": rng.standard_normal((2, 96)).astype(np.float32),
               "w.q5_0": rng.standard_normal((3, 64)).astype(np.float32)}
    writer.add_tensor("w.f32", tensors["w.f32"])
    writer.add_tensor("w.f16", tensors["w.f16"].astype(np.float16))
    for name, qtype in (("w.q8_0", gguf.GGMLQuantizationType.Q8_0), ("w.q4_1", gguf.GGMLQuantizationType.Q4_1),
                        ("w.q5_0", gguf.GGMLQuantizationType.Q5_0)):
        writer.add_tensor(name, gguf.quants.quantize(tensors[name], qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("alignment", [32, 64])
def test_small_file_reads_as_the_gguf_package_reads_it(tmp_path, alignment):
    path = tmp_path / "small.gguf"
    tensors = write_small_gguf(path, alignment)
    assert_same_as_gguf_reader(str(path))
    file = read_gguf_file(str(path))
    assert file.version == 3 and file.metadata["t.string"] == "héllo ✓" and file.metadata["t.strings"] == 3
    for name, expected in tensors.items():
        np.testing.assert_allclose(dequantize(file.tensors[name]), expected, atol=0.2 if "q4" in name else 0.1)


def test_the_shipped_model_reads_as_the_gguf_package_reads_it():
    assert_same_as_gguf_reader(resolve_model_path("smollm2-135m"))


def test_reading_the_header_is_much_faster_than_the_gguf_package():
    """The point of the reader: it steps over the tokenizer's ~100k strings instead of viewing each."""
    path = resolve_model_path("smollm2-135m")
    read_gguf_file(path)  # the first read also brings the file into the page cache: not the reader's cost
    ours = best_time(lambda: read_gguf_file(path))  # best of three: a busy machine can stall one read
    theirs = best_time(lambda: gguf.GGUFReader(path), repeats=1)
    assert ours * 10 < theirs, (ours, theirs)  # about 120x on one core


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"", "it is empty"),
    (lambda b: b"GGML" + b[4:], "not a GGUF file: it starts with b'GGML'"),
    (lambda b: b[:4] + (1).to_bytes(4, "little") + b[8:], "GGUF version 1"),
    (lambda b: b[:4] + (3).to_bytes(4, "big") + b[8:], "big-endian"),
    (lambda b: b[:30], "ends inside its header|runs .* past the end"),
    (lambda b: b[:-40], "cut short: tensor 'w.q5_0'"),  # the last tensor
])
def test_damaged_files_are_refused_with_the_reason(tmp_path, damage, message):
    good = tmp_path / "good.gguf"
    write_small_gguf(good)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(ValueError, match=message) as error:
        read_gguf_file(str(bad))
    assert str(bad) in str(error.value)


def test_metadata_a_model_cannot_have_is_refused_by_name(tmp_path):
    path = tmp_path / "zero_heads.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("llama.attention.head_count", 0), ("llama.embedding_length", 64),
                       ("llama.feed_forward_length", 128), ("llama.block_count", 1)):
        writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="head_count must be an integer >= 1, got 0") as error:
        load_model(str(path))
    assert str(path) in str(error.value)


def test_a_gguf_file_without_model_metadata_is_refused_by_name(tmp_path):
    path = tmp_path / "small.gguf"
    write_small_gguf(path)  # architecture 'llama', but no llama.* keys
    with pytest.raises(ValueError, match="has no token embedding tensor 'token_embd.weight'"):
        load_model(str(path))
