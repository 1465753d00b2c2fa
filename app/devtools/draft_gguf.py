"""A smaller model of the same vocabulary: a GGUF cut down to its first N blocks, for draft-model tests and benches.

No second model can be downloaded here, and a draft model must share the target's tokenizer. A copy of the
target that keeps its embeddings, its first N transformer blocks (`blk.0` … `blk.N-1`), the output norm and the
output matrix is a real, smaller model of that vocabulary: the residual stream after N blocks is already a
usable guess of the next token on easy text, so it drafts with an acceptance well below 1 (unlike the target
drafting for itself, which is accepted ~always). Every metadata key is copied, `<arch>.block_count` set to N;
tensors are copied raw in their own (quantized) types, so the copy loads with the same kernels.

On Gemma 3 270M the 262k-token output matrix is most of the per-token work, so a 6-of-18-block copy is not much
faster than the whole model: good for correctness, not for speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.")
WRITER_VERSION = 1


def block_count(path: str | Path) -> tuple[str, int]:
    """The GGUF's architecture and its number of blocks."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    return arch, int(reader.fields[f"{arch}.block_count"].contents())


def truncate_layers(source: str | Path, path: str | Path, n_layers: int, keep_last: bool = False) -> dict:
    """Write a copy of source with only its first n_layers blocks to path; returns what was written.

    keep_last: the first n_layers - 1 blocks and the source's last one (renumbered n_layers - 1), whose output the
    output norm and matrix were trained on."""
    t0 = time.monotonic()
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= n_layers <= total:
        raise ValueError(f"{source} has {total} blocks: keep 1 to {total}, not {n_layers}")
    # Source block → its number in the copy.
    blocks = {i: i for i in range(n_layers - 1 if keep_last else n_layers)}
    if keep_last:
        blocks[total - 1] = n_layers - 1
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # The architecture and the GGUF.* counters are the writer's own.
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = n_layers if field.name == count_key else field.contents()
        if field.name == "general.name":
            value = f"{value} (first {n_layers} of {total} blocks)"
        w.add_key_value(field.name, value, vtype, sub_type=sub_type)
    kept = []
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        name = t.name
        if m is not None:
            if int(m.group(1)) not in blocks:
                continue
            name = f"blk.{blocks[int(m.group(1))]}." + t.name[m.end():]
        kept.append(t)
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in kept:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    w.close()
    tmp.replace(path)
    return {"path": str(path), "source": str(source), "architecture": arch, "n_layers": n_layers,
            "source_layers": total, "tensors": len(kept), "file_bytes": path.stat().st_size,
            "seconds": time.monotonic() - t0}


def cache_dir() -> Path:
    """Where generated draft models are kept ($HEARTH_DRAFT_CACHE, else ~/.cache/hearth/drafts)."""
    return Path(os.environ.get("HEARTH_DRAFT_CACHE") or "~/.cache/hearth/drafts").expanduser()


def fingerprint(path: str | Path, sample_bytes: int = 1 << 20) -> str:
    """A content key of a GGUF: its size and a hash of its first and last MiB (header, metadata and weights at both
    ends), so every copy of one model file shares a cached draft and a changed file does not."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(sample_bytes))
        f.seek(max(0, size - sample_bytes))
        h.update(f.read(sample_bytes))
    return h.hexdigest()


def cached_draft(source: str | Path, n_layers: int = 6) -> Path:
    """The n_layers-block copy of source, written into the cache the first time, then reused.

    The name carries the source's content key (fingerprint), the block count and this writer's version, so a
    changed source never reuses a stale copy."""
    key = json.dumps({"source": fingerprint(source), "n_layers": n_layers, "v": WRITER_VERSION}, sort_keys=True)
    path = cache_dir() / f"{Path(source).stem}-{n_layers}l-{hashlib.sha256(key.encode()).hexdigest()[:12]}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        truncate_layers(source, path, n_layers)
    return path


def run_from_args(args, source: str) -> int:
    """`hearth models truncate`: write the layer-truncated copy of a GGUF and print its path."""
    info = truncate_layers(source, args.out, args.layers)
    print(f"{info['path']}: {Path(source).name} with its first {info['n_layers']} of {info['source_layers']} "
          f"blocks, {info['file_bytes'] / 2**20:,.1f} MiB in {info['seconds']:.1f} s")
    return 0
