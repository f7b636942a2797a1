"""benchmarks/model_parts.py: the model file in parts for the device machine, joined and checked there."""
import hashlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(*args, cwd):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "model_parts.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_split_then_join_gives_the_original_bytes_where_minfer_looks(tmp_path):
    data = bytes(range(256)) * 5000 + b"tail"  # 1.22 MiB: three parts of 0.5 MiB, the last one short
    (tmp_path / "model.gguf").write_bytes(data)
    split = run("split", "--model", "model.gguf", "--dir", "parts", "--part-mib", "0.5", cwd=tmp_path)
    assert split.returncode == 0, split.stderr
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["manifest.json", "part1", "part2", "part3"]
    assert (tmp_path / "parts" / "part1").stat().st_size == 2**19 > (tmp_path / "parts" / "part3").stat().st_size
    (tmp_path / "model.gguf").unlink()  # on the device machine only the parts exist
    joined = run("join", "--dir", "parts", cwd=tmp_path)
    assert joined.returncode == 0, joined.stderr
    out = tmp_path / "parts" / "site" / "model.gguf"
    assert out.read_bytes() == data and hashlib.sha256(data).hexdigest() in (tmp_path / "parts" / "manifest.json").read_text()
    assert f"export PYTHONPATH={out.parent}" in joined.stdout


def test_a_corrupted_or_missing_part_is_named_and_nothing_is_joined(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"x" * 3000)
    assert run("split", "--model", "model.gguf", "--dir", "parts", "--part-mib", str(1000 / 2**20), cwd=tmp_path).returncode == 0
    part2 = tmp_path / "parts" / "part2"
    part2.write_bytes(b"x" * 999 + b"y")  # same size, one byte changed
    bad = run("join", "--dir", "parts", cwd=tmp_path)
    assert bad.returncode == 1 and "corrupted" in bad.stderr and "['part2']" in bad.stderr
    assert not (tmp_path / "parts" / "site").exists()
    part2.unlink()
    missing = run("join", "--dir", "parts", cwd=tmp_path)
    assert missing.returncode == 1 and "missing" in missing.stderr and "['part2']" in missing.stderr


def test_a_wrong_whole_file_checksum_removes_the_joined_file(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import model_parts
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    (tmp_path / "model.gguf").write_bytes(b"abc" * 1000)
    manifest = model_parts.split_file(tmp_path / "model.gguf", tmp_path / "parts", 1024, module="pkg")
    (tmp_path / "parts" / "manifest.json").write_text(
        (tmp_path / "parts" / "manifest.json").read_text().replace(manifest["sha256"], "0" * 64))
    try:
        model_parts.join_parts(tmp_path / "parts")
        raise AssertionError("a wrong checksum was accepted")
    except ValueError as exc:
        assert "SHA-256 differs" in str(exc)
    assert not (tmp_path / "parts" / "site" / "pkg" / "model.gguf").exists()
