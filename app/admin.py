"""`hearth models|classes|settings`: the admin's edits from a shell (the dashboard will offer the same)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from app.paths import data_dir
from app.policy import MODEL_POLICIES, THINKING_MODES
from app.residency.default_model import ensure_default_model
from app.store import models as db
from app.store.db import open_store, writing_sessions

MIB = 1024 * 1024
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def runner_settings_of(s, row) -> db.RunnerSettings:
    """A model's runner settings row, created (a hearth runner, every field at its default) when it has none yet."""
    rs = s.scalar(select(db.RunnerSettings).where(db.RunnerSettings.model_id == row.id))
    if rs is None:
        rs = db.RunnerSettings(model_id=row.id, kind="hearth")
        s.add(rs)
    return rs


def _flag(value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(value)


def _thinking(value: str) -> str:
    v = value.strip().lower()
    if v not in THINKING_MODES:
        raise ValueError(value)
    return v


CLASS_FIELDS = {
    "priority": int, "ttft_target_ms": int, "tpot_target_ms": int, "default_max_tokens": int,
    "max_output_tokens": int, "max_concurrent": int, "max_queue": int, "weight": float,
    "preemptible": _flag, "queue_timeout_s": float,
    "default_model": lambda v: v.strip() or None,
    "thinking": _thinking,
    # Speculative decoding for the class's requests: on (the runner drafts where it pays) or off.
    "speculation": _flag,
    # Private: the class's prompts are never written to the runners' KV disk tier.
    "private": _flag,
}
# (lowest allowed value, what the field means) for the numeric fields; checked after conversion.
CLASS_LIMITS = {
    "priority": (0, "priority (0 runs first)"),
    "ttft_target_ms": (1, "time-to-first-token target in ms"),
    "tpot_target_ms": (1, "time-per-output-token target in ms"),
    "default_max_tokens": (1, "default max tokens"),
    "max_output_tokens": (1, "max output tokens"),
    "max_concurrent": (1, "max concurrent requests"),
    "max_queue": (0, "queue length"),
    "weight": (0.001, "fair-share weight"),
    "queue_timeout_s": (0.1, "queue timeout in seconds"),
}


class AdminError(ValueError):
    """An edit that cannot be made (the message says why)."""


class ClassFieldErrors(AdminError):
    """Some class fields are not valid; `errors` maps each field to what is wrong with it."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


def parse_class_fields(values: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """Typed class fields from text (CLI FIELD=VALUE or a form) and a message per invalid field."""
    parsed, errors = {}, {}
    for field, raw in values.items():
        if field not in CLASS_FIELDS:
            errors[field] = f"unknown field; one of {', '.join(CLASS_FIELDS)}"
            continue
        try:
            value = CLASS_FIELDS[field](raw)
        except ValueError:
            kind = {int: "a whole number", float: "a number",
                    _thinking: "one of " + ", ".join(THINKING_MODES)}.get(CLASS_FIELDS[field], "yes or no")
            errors[field] = f"{raw!r} is not a valid {field}: enter {kind}"
            continue
        if field in CLASS_LIMITS and value < CLASS_LIMITS[field][0]:
            low, what = CLASS_LIMITS[field]
            errors[field] = f"{what} must be at least {low:g}"
            continue
        parsed[field] = value
    return parsed, errors


def update_class(s, name: str, values: dict[str, str]) -> db.RequestClass:
    """Validate and apply text values to a stored class; raises ClassFieldErrors and changes nothing if any is bad."""
    row = s.get(db.RequestClass, name)
    if row is None:
        raise AdminError(f"no class '{name}'")
    parsed, errors = parse_class_fields(values)
    default_tokens = parsed.get("default_max_tokens", row.default_max_tokens)
    max_tokens = parsed.get("max_output_tokens", row.max_output_tokens)
    if "default_max_tokens" not in errors and "max_output_tokens" not in errors and default_tokens > max_tokens:
        errors["default_max_tokens"] = f"default max tokens ({default_tokens}) is above max output tokens ({max_tokens})"
    if errors:
        raise ClassFieldErrors(errors)
    for field, value in parsed.items():
        setattr(row, field, value)
    return row


def set_model_policy(s, name: str, policy: str | None = None, keep_alive_s: int | None = None) -> db.Model:
    """Change a model's residency policy and/or keep-alive TTL in the store (the caller commits)."""
    row = s.scalar(select(db.Model).where(db.Model.name == name))
    if row is None:
        raise AdminError(f"no model '{name}'; `hearth models list` scans the models folder and shows the names")
    if policy is not None and policy not in MODEL_POLICIES:
        raise AdminError(f"unknown policy '{policy}'; choose from {', '.join(MODEL_POLICIES)}")
    if keep_alive_s is not None and keep_alive_s < 1:
        raise AdminError(f"keep-alive must be at least 1 s (got {keep_alive_s}); use policy on_demand to unload at once")
    if policy is not None:
        row.policy = policy
    if keep_alive_s is not None:
        row.keep_alive_s = keep_alive_s
    return row


def set_model_speculation(s, name: str, value: str) -> db.RunnerSettings:
    """Set a model's speculative decoding (auto, off or an n-gram type) on its runner settings (the caller commits).

    Stored as NULL for auto, so a model left alone follows what auto means in a later Hearth. Raises
    AdminError for an unknown model, an unknown value, or a type its runner kind cannot draft with."""
    from app.residency.runner_spec import SPEC_AUTO, speculation_problem

    row = s.scalar(select(db.Model).where(db.Model.name == name))
    if row is None:
        raise AdminError(f"no model '{name}'; `hearth models list` scans the models folder and shows the names")
    rs = s.scalar(select(db.RunnerSettings).where(db.RunnerSettings.model_id == row.id))
    value = value.strip().lower()
    problem = speculation_problem(rs.kind if rs else "hearth", value)
    if problem:
        raise AdminError(f"speculative decoding '{value}': {problem}")
    rs = rs or runner_settings_of(s, row)
    rs.speculation = None if value == SPEC_AUTO else value
    return rs


def set_model_draft(s, name: str, value: str) -> db.RunnerSettings:
    """Set (or clear, with "" or "none") the model that drafts for a model, by catalog name, on its runner settings
    (the caller commits). Raises AdminError for an unknown model, or a draft that is the model itself or unknown;
    whether its vocabulary matches is the catalog's check (app.services.catalog.draft_problem), made by the caller
    that has the files, and again by the runner when it loads."""
    row = s.scalar(select(db.Model).where(db.Model.name == name))
    if row is None:
        raise AdminError(f"no model '{name}'; `hearth models list` scans the models folder and shows the names")
    value = value.strip()
    draft = None if value.lower() in ("", "none") else value
    if draft == name:
        raise AdminError(f"{name} cannot be its own draft model: choose a smaller model of its family")
    if draft is not None and s.scalar(select(db.Model).where(db.Model.name == draft)) is None:
        raise AdminError(f"no model '{draft}' to draft with; `hearth models list` shows the names")
    rs = runner_settings_of(s, row)
    rs.draft_model = draft
    return rs


def set_model_kv_types(s, name: str, type_k: str, type_v: str | None = None) -> db.RunnerSettings:
    """Set a model's KV cache types (-ctk / -ctv; V the same as K unless given) on its runner settings (the caller
    commits). Stored as NULL for f16, llama.cpp's default. Raises AdminError for an unknown model or type."""
    from app.engine.kv_types import DEFAULT_KV_TYPE, kv_type_problem

    row = s.scalar(select(db.Model).where(db.Model.name == name))
    if row is None:
        raise AdminError(f"no model '{name}'; `hearth models list` scans the models folder and shows the names")
    type_k = type_k.strip().lower()
    type_v = (type_v or type_k).strip().lower()
    problem = kv_type_problem(type_k, type_v)
    if problem:
        raise AdminError(f"KV cache type: {problem}")
    rs = runner_settings_of(s, row)
    rs.cache_type_k = None if type_k == DEFAULT_KV_TYPE else type_k
    rs.cache_type_v = None if type_v == DEFAULT_KV_TYPE else type_v
    return rs


# llama.cpp's device limit (llama_max_devices(): 16 GPUs); a share past MAX_SHARE says nothing a smaller ratio cannot.
MAX_DEVICES = 16
MAX_SHARE = 1e6
# A model has at most a few hundred layers: more experts-in-RAM layers than this is a typo, not a placement.
MAX_CPU_MOE_LAYERS = 4096


def placement_number_problems(tensor_split: str | None = None, main_gpu: int | str | None = None,
                              n_cpu_moe: int | None = None) -> dict[str, str]:
    """What is wrong with a placement's numbers, by field: shares finite, 0 to MAX_SHARE, at most MAX_DEVICES of them,
    not all 0; a GPU index 0 to MAX_DEVICES - 1; experts-in-RAM layers -1 to MAX_CPU_MOE_LAYERS. Shared by the CLI
    and the Models page, so nan, inf or 1e308 is refused on both (float() takes all three)."""
    problems = {}
    if tensor_split:
        try:
            shares = [float(x) for x in tensor_split.split(",")]
        except ValueError:
            shares = []
        if not shares or len(shares) > MAX_DEVICES or not all(math.isfinite(x) and 0 <= x <= MAX_SHARE for x in shares) \
                or not any(shares):
            problems["tensor_split"] = (f"--tensor-split {tensor_split[:40]!r}: up to {MAX_DEVICES} comma-separated "
                                        f"shares, each a number from 0 to {MAX_SHARE:,.0f}, not all 0, e.g. 3,1")
    if main_gpu is not None:
        text = str(main_gpu).strip()
        if not text.isdigit() or int(text) >= MAX_DEVICES:
            problems["main_gpu"] = f"--main-gpu {text[:24]}: a GPU's index, 0 to {MAX_DEVICES - 1}"
    if n_cpu_moe is not None and not -1 <= n_cpu_moe <= MAX_CPU_MOE_LAYERS:
        problems["n_cpu_moe"] = (f"--n-cpu-moe {n_cpu_moe}: the number of layers whose experts stay in RAM, 0 to "
                                 f"{MAX_CPU_MOE_LAYERS:,} (-1: every layer)")
    return problems


def set_model_placement(s, name: str, n_cpu_moe: int | None = None, devices: str | None = None,
                        tensor_split: str | None = None, split_mode: str | None = None,
                        main_gpu: int | None = None) -> db.RunnerSettings:
    """Set where a model's weights go (the caller commits): experts in RAM (--n-cpu-moe N, -1 every layer's), its GPUs
    (--device names, '' all), their shares (--tensor-split, '' by free memory), --split-mode and --main-gpu; None
    leaves a setting as it is. Raises AdminError for an unknown model or a value the runner would refuse."""
    row = s.scalar(select(db.Model).where(db.Model.name == name))
    if row is None:
        raise AdminError(f"no model '{name}'; `hearth models list` scans the models folder and shows the names")
    problems = placement_number_problems(tensor_split, main_gpu, n_cpu_moe)
    if problems:
        raise AdminError("; ".join(problems.values()))
    if split_mode is not None and split_mode not in ("none", "layer", "row"):
        raise AdminError(f"--split-mode {split_mode!r}: none, layer or row")
    rs = runner_settings_of(s, row)
    if n_cpu_moe is not None:
        rs.n_cpu_moe = n_cpu_moe or None
    if devices is not None:
        rs.devices = ",".join(d.strip() for d in devices.split(",") if d.strip()) or None
    if tensor_split is not None:
        rs.tensor_split = tensor_split.strip() or None
    if split_mode is not None:
        rs.split_mode = None if split_mode == "layer" else split_mode
    if main_gpu is not None:
        rs.main_gpu = main_gpu or None
    return rs


def set_model_weights(s, name: str, value: str) -> db.RunnerSettings:
    """Set a model's weights choice (pinned, warm or cold: its file in the page cache while no runner maps it)
    on its runner settings (the caller commits). Stored as NULL for warm, the default. Raises AdminError for an
    unknown model or value."""
    from app.residency.pagecache import WEIGHTS_WARM, weights_problem

    row = s.scalar(select(db.Model).where(db.Model.name == name))
    if row is None:
        raise AdminError(f"no model '{name}'; `hearth models list` scans the models folder and shows the names")
    value = value.strip().lower()
    problem = weights_problem(value)
    if problem:
        raise AdminError(f"weights '{value}': {problem}")
    rs = runner_settings_of(s, row)
    rs.weights = None if value == WEIGHTS_WARM else value
    return rs


def run(args) -> int:
    """Dispatch `hearth models|classes|settings ...`."""
    data = data_dir()
    engine, sessions = open_store(data)
    try:
        if args.command == "models" and args.models_command == "list":
            list_models(data, sessions)
            return 0
        # The write lock first (writing_sessions): serve's writer may commit while this command reads.
        with writing_sessions(engine)() as s:
            handler = {"models": _models, "classes": _classes, "settings": _settings}[args.command]
            handler(args, s, data)
            s.commit()
    except AdminError as exc:
        print(f"hearth {args.command}: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    return 0


def pull_model(s, data: Path, source: str) -> Path:
    """`hearth models pull SOURCE`: download a GGUF into the models folder with a progress bar, checked
    against the disk and the memory budget (the runner settings of the store) before the weights come; a Piper
    voice's .onnx URL pulls the voice (app.residency.voice_pull)."""
    from tqdm import tqdm

    from app.residency.library import HostPolicy, Pull, PullError, budget_refusal, pull, resolve
    from app.residency.voice_pull import is_voice_source, pull_voice
    from app.services.catalog import resolve_models_dir
    from app.services.settings import budget_bytes
    from app.store.settings import get_setting

    ctx, parallel, batch = (get_setting(s, f"runner_{k}") for k in ("ctx", "parallel", "batch"))
    budget = budget_bytes(_SessionSettings(s))
    models_dir = resolve_models_dir(data, get_setting(s, "models_dir"), os.environ.get("HEARTH_MODELS_DIR"))
    models_dir.mkdir(parents=True, exist_ok=True)
    try:
        try:
            hosts = HostPolicy.parse(get_setting(s, "pull_allowed_hosts"))
        except ValueError as exc:
            raise PullError(f"the setting pull_allowed_hosts cannot be read: {exc}") from exc
        if is_voice_source(source):
            return pull_voice(source, models_dir, hosts, Pull(source))
        src = resolve(source, get_setting(s, "hf_endpoint"), hosts)
        with tqdm(total=src.size_bytes, unit="B", unit_scale=True, desc=src.filename, file=sys.stderr) as bar:
            def progress(p) -> None:
                bar.total = p.total_bytes
                bar.update(p.done_bytes - bar.n)

            return pull(src, models_dir, lambda m: budget_refusal(m, ctx, parallel, int(batch), budget), progress,
                        hosts=hosts)
    except PullError as exc:
        raise AdminError(str(exc)) from exc


class _SessionSettings:
    """Settings read straight from one session, shaped like the serve's settings cache."""

    def __init__(self, session):
        self.session = session

    def get(self, name: str):
        """The stored (or default) value of a setting."""
        from app.store.settings import get_setting

        return get_setting(self.session, name)


def list_models(data: Path, sessions: sessionmaker) -> None:
    """`hearth models list`: scan and record the catalog as serve does (same folder, same runner settings), print it."""
    from app.services.catalog import Catalog
    from app.services.settings import SettingsCache

    override = os.environ.get("HEARTH_DEFAULT_MODEL")
    default = Path(override) if override else ensure_default_model(data, progress=True)
    catalog = Catalog.open(data, sessions, SettingsCache(sessions), default, os.environ.get("HEARTH_MODELS_DIR"))
    specs = catalog.model_specs()
    with sessions() as s:
        rows = {r.name: r for r in s.scalars(select(db.Model))}
    print(f"{'name':<28} {'arch':<10} {'params':>8} {'quant':<8} {'ctx':>6} {'file':>9} "
          f"{'runner':>11} {'estimate':>9}  policy / reason")
    for e in catalog.entries:
        row, spec = rows.get(e.name), specs.get(e.name)
        if spec is not None:
            runner = f"{spec.runner.n_ctx}×{spec.runner.parallel}" if spec.runner else "remote"
            print(f"{e.name:<28} {e.architecture or '-':<10} {(e.n_params or 0) / 1e6:>7.0f}M "
                  f"{e.quantization or '-':<8} {e.n_ctx_train or 0:>6} {e.size_bytes / MIB:>8.0f}M "
                  f"{runner:>11} {spec.estimate_bytes / MIB:>8.0f}M  "
                  f"{spec.policy}{' (alias ' + row.alias + ')' if row and row.alias else ''}")
        else:
            print(f"{e.name:<28} {'-':<10} {'-':>8} {'-':<8} {'-':>6} {e.size_bytes / MIB:>8.0f}M "
                  f"{'-':>11} {'-':>9}  unusable: {e.unusable_reason}")
    print(f"(runner: ctx × parallel each model's runner starts with; models folder {catalog.models_dir})")


def _models(args, s, data: Path) -> None:
    if args.models_command == "pull":
        print(pull_model(s, data, args.source))
        return
    row = s.scalar(select(db.Model).where(db.Model.name == args.name))
    if row is None:
        raise AdminError(f"no model '{args.name}'; `hearth models list` scans the models folder and shows "
                         "the names")
    if args.models_command == "node":
        existing = s.scalar(select(db.Node).where(db.Node.model_id == row.id, db.Node.url == args.url))
        if args.action == "add":
            if not args.url.startswith(("http://", "https://")):
                raise AdminError(f"'{args.url}' is not an http(s) URL")
            if existing is None:
                s.add(db.Node(model_id=row.id, url=args.url, label=args.label or args.url, enabled=True))
            print(f"{args.name}: node {args.url} added")
        else:
            if existing is None:
                raise AdminError(f"{args.name} has no node {args.url}")
            s.delete(existing)
            print(f"{args.name}: node {args.url} removed")
        return
    set_model_policy(s, args.name, args.policy or None, args.keep_alive_s)
    if args.alias is not None:
        from app.services.catalog import alias_problem

        problem = alias_problem(s, args.alias, row.name) if args.alias else None
        if problem:
            raise AdminError(f"'{args.alias}' cannot name {row.name}: {problem}")
        row.alias = args.alias.strip() or None
    runner_fields = {"kind": args.runner, "binary_path": args.binary, "n_ctx": args.ctx, "parallel": args.parallel,
                     "n_batch": args.batch, "threads": args.threads, "gpu_layers": args.gpu_layers, "mode": args.mode}
    if any(v is not None for v in runner_fields.values()):
        rs = runner_settings_of(s, row)
        for k, v in runner_fields.items():
            if v is not None:
                setattr(rs, k, v)
        if rs.kind == "llama-server" and not rs.binary_path:
            raise AdminError("--runner llama-server needs --binary PATH (see scripts/build_llama_tools.sh)")
    if getattr(args, "draft_model", None) is not None:
        set_model_draft(s, args.name, args.draft_model)
    if getattr(args, "kv_type", None) is not None:
        set_model_kv_types(s, args.name, args.kv_type)
    placement = {k: getattr(args, k, None) for k in ("n_cpu_moe", "devices", "tensor_split", "split_mode", "main_gpu")}
    if any(v is not None for v in placement.values()):
        set_model_placement(s, args.name, **placement)
    print(f"{args.name}: updated (hearth serve applies it at its next catalog rescan)")


def _classes(args, s, data: Path) -> None:
    if args.classes_command == "list":
        rows = s.scalars(select(db.RequestClass).order_by(db.RequestClass.priority, db.RequestClass.name)).all()
        print(f"{'class':<11} {'prio':>4} {'TTFT ms':>8} {'TPOT ms':>8} {'tokens':>11} {'conc':>5} {'queue':>6} "
              f"{'weight':>6} {'preempt':>8} {'timeout':>8} {'thinking':>8} {'drafts':>6} {'private':>7}  model")
        for r in rows:
            print(f"{r.name:<11} {r.priority:>4} {r.ttft_target_ms:>8} {r.tpot_target_ms:>8} "
                  f"{f'{r.default_max_tokens}/{r.max_output_tokens}':>11} {r.max_concurrent:>5} {r.max_queue:>6} "
                  f"{r.weight:>6g} {'yes' if r.preemptible else 'no':>8} {r.queue_timeout_s:>7g}s {r.thinking:>8} "
                  f"{'yes' if r.speculation else 'no':>6} {'yes' if r.private else 'no':>7}  "
                  f"{r.default_model or '(household default)'}")
        return
    values = {}
    for a in args.assignments:
        field, sep, value = a.partition("=")
        if not sep or field not in CLASS_FIELDS:
            raise AdminError(f"'{a}': expected FIELD=VALUE with FIELD one of {', '.join(CLASS_FIELDS)}")
        values[field] = value
    update_class(s, args.name, values)
    print(f"class {args.name}: updated")


def _settings(args, s, data: Path) -> None:
    from app.store.settings import (
        REGISTRY,
        Invalid,
        UnknownSetting,
        all_settings,
        conflicts,
        run_time_choices,
        set_setting,
        validate,
    )

    if args.settings_command == "list":
        for name, value in all_settings(s).items():
            d = REGISTRY[name]
            rules = "; ".join(x for x in (d.bounds(), "needs a restart" if d.restart else "") if x)
            print(f"{name:<32} {json.dumps(value):<14} [{d.section}] {d.help}{f' ({rules})' if rules else ''}")
        return
    # 'null' (or nothing) restores the default; anything else is read by the setting's kind.
    raw = "" if args.value.strip().lower() == "null" else args.value
    try:
        value = validate(args.name, raw, run_time_choices(s, args.name))
    except UnknownSetting:
        raise AdminError(f"unknown setting '{args.name}'; known: {', '.join(REGISTRY)}")
    except Invalid as exc:
        raise AdminError(str(exc))
    before = all_settings(s)
    new = {n: p for n, p in conflicts(before | {args.name: value}).items() if n not in conflicts(before)}
    if new:
        raise AdminError("; ".join(new.values()))
    set_setting(s, args.name, value)
    note = " (restart hearth serve to apply)" if REGISTRY[args.name].restart else ""
    print(f"{args.name} = {json.dumps(REGISTRY[args.name].default if value is None else value)}{note}")
