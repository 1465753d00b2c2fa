"""The model catalog: the embedded default model plus every GGUF in the models folder.

Each entry carries what residency decisions need — architecture, size, quantisation, attention
shape — read from the GGUF header alone (app.gguf_meta), so a scan costs milliseconds
per file and never loads weights. A file Hearth cannot serve is listed as unusable with the
reason, never raised: one bad download must not hide the other models.
"""

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gguf.constants import LlamaFileType

from app.engine.formats import detect
from app.gguf_meta import GgufArray, GgufError, GgufMetadata, read_metadata

log = logging.getLogger(__name__)

SOURCE_DEFAULT = "default"
SOURCE_FOLDER = "folder"

# Every name in LLM_ARCH_NAMES of the llama.cpp vendored by llama-cpp-python==0.3.36
# (vendor/llama.cpp/src/llama-arch.cpp), minus "clip" (a dummy entry that only llama-quantize
# uses; such files are vision projectors) and "(unknown)". Update it with the pin.
SUPPORTED_ARCHITECTURES = frozenset({
    "afmoe", "apertus", "arcee", "arctic", "arwkv7", "baichuan", "bailingmoe", "bailingmoe2",
    "bailingmoe3", "bert", "bitnet", "bloom", "chameleon", "chatglm", "codeshell", "cogvlm",
    "cohere2", "cohere2moe", "command-r", "dbrx", "deci", "deepseek", "deepseek2",
    "deepseek2-ocr", "deepseek32", "deepseek4", "dflash", "dots1", "dots3note", "dream",
    "eagle3", "ernie4_5", "ernie4_5-moe", "eurobert", "exaone", "exaone-moe", "exaone4",
    "falcon", "falcon-h1", "gemma", "gemma-embedding", "gemma2", "gemma3", "gemma3n", "gemma4",
    "gemma4-assistant", "glm-dsa", "glm4", "glm4moe", "glm5-next", "gpt-oss", "gpt2", "gptj",
    "gptneox", "granite", "granite_swa", "granitehybrid", "granitemoe", "graniteswitch",
    "grok", "grovemoe", "hrm_text", "hunyuan-dense", "hunyuan-moe", "hunyuan_vl", "hy_v3",
    "hy_v4", "internlm2", "jais", "jais2", "jamba", "jina-bert-v2", "jina-bert-v3", "kimi-k3",
    "kimi-linear", "laguna", "lfm2", "lfm2moe", "llada", "llada-moe", "llama", "llama-embed",
    "llama4", "maincoder", "mamba", "mamba2", "maple", "mellum", "mimo2", "minicpm",
    "minicpm3", "minimax-01", "minimax-m2", "minimax-m3", "mistral3", "mistral4",
    "modern-bert", "mpt", "muse-glimmer", "nanbeige", "nemotron", "nemotron_h",
    "nemotron_h_moe", "neo-bert", "nomic-bert", "nomic-bert-moe", "olmo", "olmo2", "olmoe",
    "openelm", "orion", "paddleocr", "pangu-embedded", "phi2", "phi3", "phimoe", "plamo",
    "plamo2", "plamo3", "plm", "pockettts", "qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3",
    "qwen35", "qwen35moe", "qwen3moe", "qwen3next", "qwen3tts", "qwen3vl", "qwen3vlmoe",
    "qwen4exp", "refact", "rnd1", "rwkv6", "rwkv6qwen2", "rwkv7", "seed_oss", "smallthinker",
    "smollm3", "spark2_5", "stablelm", "starcoder", "starcoder2", "step35", "t5", "t5encoder",
    "talkie", "wavtokenizer-dec", "xverse",
})

# llama.cpp's split files are named <prefix>-00001-of-00003.gguf (llama_split_path) and carry
# split.no / split.count; only the first is handed to llama.cpp, which opens the rest itself.
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})$")
_KEY_SPLIT_NO = "split.no"
_KEY_SPLIT_COUNT = "split.count"
_KEY_SPLIT_TENSORS = "split.tensors.count"
_KEY_FILE_TYPE = "general.file_type"
_KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
_KEY_TOKENS = "tokenizer.ggml.tokens"


@dataclass(frozen=True)
class CatalogEntry:
    """One model file as the catalog sees it; header facts are None when it could not be read."""

    name: str
    path: Path
    source: str
    size_bytes: int
    mtime: float
    usable: bool
    unusable_reason: str | None = None
    architecture: str | None = None
    n_params: int | None = None
    weights_bytes: int | None = None
    quantization: str | None = None
    n_ctx_train: int | None = None
    n_layers: int | None = None
    n_embd: int | None = None
    n_ff: int | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    head_dim_k: int | None = None
    head_dim_v: int | None = None
    n_swa: int | None = None
    n_vocab: int | None = None
    # The vocabulary's digest (app.gguf_meta): a model of the same digest can be its draft model.
    vocab_digest: str | None = None
    has_chat_template: bool = False
    # What its own chat template says it can do (app.engine.formats.detect, as llama.cpp decides): the
    # family's answer format, whether the template takes tools natively, whether the model thinks.
    # None without a template of its own (the runner then prompts it in its architecture's or ChatML).
    chat_format: str | None = None
    native_tools: bool = False
    reasoning: bool = False
    # The vision projector paired with it (pair_projectors), passed to its runner as --mmproj; None: text only.
    mmproj: Path | None = None


def scan(
    models_dir: Path | None,
    default_model: Path | None,
    previous: Iterable[CatalogEntry] = (),
) -> list[CatalogEntry]:
    """Lists the default model and every *.gguf in models_dir; never raises for a bad file."""
    # Entries from an earlier scan are reused while their file's size and mtime are unchanged,
    # so a scheduled rescan of a folder of large models does not re-walk every vocabulary.
    known = {(entry.path, entry.source): entry for entry in previous}
    entries: list[CatalogEntry] = []
    names: set[str] = set()
    if default_model is not None:
        entry = _entry_for(Path(default_model), SOURCE_DEFAULT, known)
        entries.append(_renamed(entry, names))
    for path in _gguf_files(models_dir):
        if default_model is not None and _same_file(path, Path(default_model)):
            # The default model is assembled into the data folder, which may be the models
            # folder too; it is listed once, as the default.
            continue
        if path.exists() and not is_inside(path, models_dir):
            entries.append(_renamed(_unusable(path, SOURCE_FOLDER, 0, 0.0, OUTSIDE_REASON), names))
            continue
        entries.append(_renamed(_entry_for(path, SOURCE_FOLDER, known), names))
    return pair_projectors(entries)


OUTSIDE_REASON = "a link to a file outside the models folder: only files inside it are served"
PROJECTOR_REASON = "a vision projector (architecture 'clip'), not a language model"
# A projector's own type suffix (mmproj-gemma-3-4b-it-f16.gguf), left out when its name is matched to a model's.
_PROJECTOR_TYPE = re.compile(r"[-_.](f16|f32|bf16|q8_0|q4_0|q4_k_m|q6_k|fp16|fp32)$", re.IGNORECASE)


def pair_projectors(entries: list[CatalogEntry]) -> list[CatalogEntry]:
    """Each usable model with the vision projector beside it, paired by name, as llama.cpp's downloads name
    them: mmproj-<model>[-<type>].gguf pairs with the models whose file name starts with <model>; a bare
    mmproj[-<type>].gguf with the one model of its folder. The longest matching name wins; none: text only."""
    projectors = [e for e in entries if e.unusable_reason == PROJECTOR_REASON]
    out = []
    for e in entries:
        if not e.usable:
            out.append(e)
            continue
        folder, stem = e.path.parent, e.path.stem.lower()
        best: tuple[int, Path] | None = None
        models_here = sum(1 for m in entries if m.usable and m.path.parent == folder)
        for p in projectors:
            if p.path.parent != folder:
                continue
            base = _PROJECTOR_TYPE.sub("", p.path.stem.lower())
            base = base.removeprefix("mmproj").lstrip("-_.")
            if (base and stem.startswith(base)) or (not base and models_here == 1):
                if best is None or len(base) > best[0]:
                    best = (len(base), p.path)
        out.append(replace(e, mmproj=best[1] if best else None))
    return out


def is_inside(path: Path, folder: Path) -> bool:
    """True when path, with every symlink and '..' resolved, lies inside folder."""
    try:
        return Path(path).resolve(strict=False).is_relative_to(Path(folder).resolve(strict=False))
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return False


def _gguf_files(models_dir: Path | None) -> list[Path]:
    """Returns the folder's *.gguf files (any case), sorted; an unreadable folder gives none."""
    if models_dir is None:
        return []
    try:
        children = list(Path(models_dir).iterdir())
    except OSError as exc:
        log.warning("cannot list the models folder %s: %s", models_dir, exc)
        return []
    # Dot-files are skipped: downloaders and editors write partial files under hidden names.
    return sorted(
        child for child in children
        if child.suffix.lower() == ".gguf" and not child.name.startswith(".")
    )


def _same_file(a: Path, b: Path) -> bool:
    """Tells whether two paths name the same file; False when either cannot be stat()ed."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _renamed(entry: CatalogEntry, names: set[str]) -> CatalogEntry:
    """Gives the entry a name not yet taken, adding -2, -3… to its stem on a collision."""
    name = entry.name
    suffix = 2
    while name in names:
        name = f"{entry.name}-{suffix}"
        suffix += 1
    names.add(name)
    return entry if name == entry.name else replace(entry, name=name)


def _entry_for(
    path: Path, source: str, known: dict[tuple[Path, str], CatalogEntry]
) -> CatalogEntry:
    """Builds the entry for one file, turning every failure into an unusable entry."""
    try:
        stat = path.stat()
    except OSError as exc:
        return _unusable(path, source, 0, 0.0, f"cannot read the file: {exc.strerror or exc}")
    previous = known.get((path, source))
    unchanged = previous is not None and previous.size_bytes == stat.st_size
    if unchanged and previous.mtime == stat.st_mtime:
        # Its name may carry a collision suffix from the last scan; collisions are redone.
        return replace(previous, name=path.stem)
    try:
        return _read_entry(path, source, stat.st_size, stat.st_mtime)
    except GgufError as exc:
        return _unusable(path, source, stat.st_size, stat.st_mtime, str(exc))
    except OSError as exc:
        return _unusable(
            path, source, stat.st_size, stat.st_mtime,
            f"cannot read the file: {exc.strerror or exc}",
        )
    except Exception as exc:
        # Model files are third-party input and the catalog must list the rest regardless;
        # the log keeps the traceback of what this reader did not foresee.
        log.exception("unexpected failure reading %s", path)
        return _unusable(
            path, source, stat.st_size, stat.st_mtime,
            f"unreadable header ({type(exc).__name__}: {exc})",
        )


def _unusable(path: Path, source: str, size_bytes: int, mtime: float, reason: str) -> CatalogEntry:
    """Returns an entry that only names the file and why it cannot be served."""
    return CatalogEntry(
        name=path.stem, path=path, source=source, size_bytes=size_bytes, mtime=mtime,
        usable=False, unusable_reason=reason,
    )


def _read_entry(path: Path, source: str, size_bytes: int, mtime: float) -> CatalogEntry:
    """Reads a GGUF header (and its split siblings) into a catalog entry."""
    match = _SPLIT_NAME.match(path.stem)
    if match and int(match["no"]) != 1:
        first = f"{match['prefix']}-00001-of-{match['count']}{path.suffix}"
        return _unusable(
            path, source, size_bytes, mtime,
            f"shard {int(match['no'])} of {int(match['count'])} of a split model: "
            f"it is served through its first shard {first}",
        )
    metadata = read_metadata(path)
    split_count = _int_or_none(metadata.fields.get(_KEY_SPLIT_COUNT)) or 1
    split_no = _int_or_none(metadata.fields.get(_KEY_SPLIT_NO)) or 0
    if split_no != 0:
        # A renamed shard: its header still says which part it is.
        return _unusable(
            path, source, size_bytes, mtime,
            f"shard {split_no + 1} of {split_count} of a split model: "
            "it is served through its first shard",
        )
    shards = [metadata]
    if split_count > 1:
        shards += _other_shards(path, match, split_count)
        size_bytes = sum(shard.file_size for shard in shards)
    entry = _entry_from_metadata(path, source, size_bytes, mtime, metadata, shards)
    reason = _unusable_reason(metadata, shards)
    if reason is not None:
        return replace(entry, usable=False, unusable_reason=reason)
    return entry


def _other_shards(path: Path, match: re.Match[str] | None, split_count: int) -> list[GgufMetadata]:
    """Reads shards 2..n of a split model; raises GgufError naming a missing or bad one."""
    if match is None:
        raise GgufError(
            f"first shard of a {split_count}-part split model, but its name does not follow "
            "<name>-00001-of-0000N.gguf, so the other parts cannot be found"
        )
    shards = []
    for number in range(2, split_count + 1):
        sibling_name = f"{match['prefix']}-{number:05d}-of-{split_count:05d}{path.suffix}"
        sibling = path.with_name(sibling_name)
        if not sibling.is_file():
            raise GgufError(f"split model is missing shard {sibling.name}")
        try:
            shards.append(read_metadata(sibling))
        except GgufError as exc:
            raise GgufError(f"shard {sibling.name}: {exc}") from exc
    return shards


def _unusable_reason(metadata: GgufMetadata, shards: list[GgufMetadata]) -> str | None:
    """Returns why llama.cpp could not serve this model, or None when it can."""
    architecture = metadata.architecture
    if architecture is None:
        return "no general.architecture key: not a model GGUF"
    if architecture == "clip":
        return PROJECTOR_REASON
    if architecture not in SUPPORTED_ARCHITECTURES:
        return (
            f"architecture {architecture!r} is not supported by the bundled llama.cpp "
            "(llama-cpp-python 0.3.36)"
        )
    n_tensors = sum(len(shard.tensors) for shard in shards)
    if n_tensors == 0:
        return "no tensors: a vocabulary-only GGUF, not a model"
    expected = _int_or_none(metadata.fields.get(_KEY_SPLIT_TENSORS))
    if len(shards) > 1 and expected is not None and expected != n_tensors:
        return f"split model's shards hold {n_tensors} tensors but its header lists {expected}"
    if _int_or_none(metadata.arch_value("block_count")) is None:
        return f"no {architecture}.block_count key: the header is incomplete"
    return None


def _entry_from_metadata(
    path: Path,
    source: str,
    size_bytes: int,
    mtime: float,
    metadata: GgufMetadata,
    shards: list[GgufMetadata],
) -> CatalogEntry:
    """Collects a usable entry's facts from the header's architecture-scoped keys."""
    n_embd = _int_or_none(metadata.arch_value("embedding_length"))
    n_head = _max_int(metadata.arch_value("attention.head_count"))
    # Without explicit key/value lengths llama.cpp derives the head size as n_embd / n_head.
    default_head_dim = n_embd // n_head if n_embd and n_head else None
    n_head_kv = _max_int(metadata.arch_value("attention.head_count_kv"))
    template = metadata.fields.get(_KEY_CHAT_TEMPLATE)
    has_template = isinstance(template, str) and bool(template.strip())
    fmt = detect(template) if has_template else None
    return CatalogEntry(
        name=path.stem,
        path=path,
        source=source,
        size_bytes=size_bytes,
        mtime=mtime,
        usable=True,
        architecture=metadata.architecture,
        n_params=sum(shard.n_params for shard in shards),
        weights_bytes=sum(shard.weights_bytes for shard in shards),
        quantization=_quantization(metadata, shards),
        n_ctx_train=_int_or_none(metadata.arch_value("context_length")),
        n_layers=_int_or_none(metadata.arch_value("block_count")),
        n_embd=n_embd,
        n_ff=_max_int(metadata.arch_value("feed_forward_length")),
        n_head=n_head,
        # llama.cpp's default when the key is absent: no grouping, one KV head per query head.
        n_head_kv=n_head_kv if n_head_kv is not None else n_head,
        head_dim_k=_int_or_none(metadata.arch_value("attention.key_length")) or default_head_dim,
        head_dim_v=_int_or_none(metadata.arch_value("attention.value_length")) or default_head_dim,
        n_swa=_int_or_none(metadata.arch_value("attention.sliding_window")) or None,
        n_vocab=_n_vocab(metadata),
        vocab_digest=metadata.vocab_digest,
        has_chat_template=has_template,
        chat_format=fmt.name if fmt else None,
        native_tools=bool(fmt and fmt.tools),
        reasoning=bool(fmt and fmt.reasoning),
    )


def _quantization(metadata: GgufMetadata, shards: list[GgufMetadata]) -> str | None:
    """Names the quantisation ("Q4_K_M") from general.file_type, else the dominant tensor type."""
    file_type = _int_or_none(metadata.fields.get(_KEY_FILE_TYPE))
    if file_type is not None and file_type != LlamaFileType.GUESSED:
        try:
            name = LlamaFileType(file_type).name
        except ValueError:
            name = None
        if name is not None:
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    # Without a file type, the type holding the most weights is what the model "is".
    elements: dict[Any, int] = {}
    for shard in shards:
        for tensor in shard.tensors:
            elements[tensor.ggml_type] = elements.get(tensor.ggml_type, 0) + tensor.n_elements
    if not elements:
        return None
    return max(elements, key=elements.__getitem__).name


def _n_vocab(metadata: GgufMetadata) -> int | None:
    """Returns the vocabulary size: <arch>.vocab_size, else the length of the token list."""
    explicit = _int_or_none(metadata.arch_value("vocab_size"))
    if explicit is not None:
        return explicit
    tokens = metadata.fields.get(_KEY_TOKENS)
    if isinstance(tokens, GgufArray):
        return tokens.count
    return None


def _int_or_none(value: Any) -> int | None:
    """Returns value if it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _max_int(value: Any) -> int | None:
    """Returns an integer key's value, or the largest entry of a per-layer array of them."""
    # Per-layer arrays (hybrid models, OpenELM) vary by layer; the largest is the safe figure
    # for memory estimates, which must not under-count.
    if isinstance(value, tuple):
        integers = [item for item in value if _int_or_none(item) is not None]
        return max(integers) if integers else None
    return _int_or_none(value)


# -- what /api/show reads from a file -------------------------------------------------------------


@dataclass(frozen=True)
class FileFacts:
    """What Ollama's /api/show tells of a GGUF beyond its catalog entry: every header field, and the
    source of the chat template the runner prompts it with (its own, its architecture's, or ChatML)."""

    fields: dict[str, Any]
    template: str | None


# A household's folder holds a handful of models; past this the least recently shown is read again.
MAX_CACHED_FACTS = 32
_facts: dict[Path, tuple[tuple[int, int], FileFacts]] = {}


def file_facts(path: Path) -> FileFacts:
    """The header fields and chat template of `path`, read once per version of the file (its size and
    mtime): clients poll /api/show, and a big vocabulary takes a whole parse. A miss is read off serve's
    event loop. Callers must not change the fields they get (they are shared)."""
    stat = os.stat(path)
    stamp = (stat.st_size, stat.st_mtime_ns)
    hit = _facts.pop(path, None)  # popped and put back: the dict's order is the recency order
    if hit is None or hit[0] != stamp:
        from app.residency.offload import off_loop

        hit = (stamp, off_loop(_read_facts, path))
    _facts[path] = hit
    while len(_facts) > MAX_CACHED_FACTS:
        _facts.pop(next(iter(_facts)), None)
    return hit[1]


def _read_facts(path: Path) -> FileFacts:
    from app.engine.chat import load_chat_template

    return FileFacts(dict(read_metadata(path).fields), load_chat_template(path).source)
