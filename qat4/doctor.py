"""`qat4 doctor`: will qat4 run on this machine, and how.

Each check is a plain function returning a :class:`Check`; :func:`diagnose` runs them all. They
ask qat4's own functions what qat4 will do (the device, dtype, kernels, prefill GEMM, PDL, CUDA
graphs, the memory plan, the loader's format detection) and never load weights or reach the
network: a checkpoint is judged by its config and file headers, a Hub model id by the local
Hugging Face cache alone, and the context by the memory plan of a model whose tensors are shapes
without data.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound, HFValidationError
from huggingface_hub.utils import validate_repo_id
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from qat4.checkpoint.hf_layout import text_plan
from qat4.checkpoint.hub import hub_cache_dir, hub_offline
from qat4.checkpoint.loader import open_checkpoint
from qat4.checkpoint.packed_model import PackedModel, TensorSpec, expected_tensors
from qat4.checkpoint.packing import GROUP, PER_WORD, PackedTensor
from qat4.commands.model_args import DEVICES, resolve_device
from qat4.config import E2B, SYNTHETIC, Gemma4Config, synthetic_config
from qat4.engine.config import MAX_CTX_DEFAULT, EngineConfig
from qat4.engine.kv_cache import pool_nbytes
from qat4.engine.memory import MIB, Plan, decode_nbytes, default_dtype, model_nbytes, plan
from qat4.engine.graphs import uses_graphs
from qat4.errors import Qat4Error
from qat4.model import dense_nbytes
from qat4.ops import use_triton
from qat4.ops._triton import TRITON_VERSION
from qat4.ops.pdl import pdl_launch
from qat4.ops.w4.gemm import has_tensor_cores, prefill_uses_fp32

STATUSES = ("ok", "warn", "fail")  # fine; runs, but read this; blocks running
GIB = 1 << 30
DISK_WARN_GIB = 10  # below this much free disk: warn (a 16-bit E2B checkpoint does not fit)
DISK_FAIL_GIB = 3  # below this: fail (hardly room for a 4-bit one)
E2B_LABEL = "for Gemma 4 E2B"
SETTINGS = ("QAT4_OPS", "QAT4_PREFILL_FP32", "QAT4_EXPAND_ROWS", "QAT4_WIDE_GEMM_ROWS", "QAT4_DENSE_ROWS", "QAT4_PDL",
            "QAT4_PAIR_UNPACK", "QAT4_L2_PREFETCH", "TRITON_INTERPRET")  # environment that steers the compute path
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Check:
    """One finding: ``status`` "ok", "warn" (qat4 runs, but read this) or "fail" (this blocks
    running); ``detail`` says what was found, in a sentence or two."""

    name: str
    status: str
    detail: str

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class ModelFacts:
    """What the model check found: its Check, the config the context is worked out for, the
    phrase naming that model, and the folder it lies in when it is on this machine."""

    check: Check
    config: Gemma4Config
    label: str
    folder: Path | None = None


def unusable(detail: str) -> ModelFacts:
    """A --model that cannot be used: a failed check, and the context worked out for E2B instead."""
    return ModelFacts(Check("model", "fail", detail), E2B, f"{E2B_LABEL} (in place of --model)")


def diagnose(model: str | None = None, *, memory_cap_mib: float | None = None, device: str | None = None,
             max_ctx: int | None = None) -> list[Check]:
    """Every check, in the order `qat4 doctor` prints them. The keywords are its flags: --model,
    --memory-cap-mib, --device and --max-ctx; a bad value (or a QAT4_OPS qat4 does not know) is a
    Qat4Error naming it. ``device`` None: cuda when a GPU is visible, else cpu (as every command)."""
    check_options(memory_cap_mib=memory_cap_mib, device=device, max_ctx=max_ctx)
    gpu, dev = check_gpu(device)
    found = inspect_model(model)
    return [
        check_python(),
        check_torch(),
        check_triton(dev),
        gpu,
        check_compute_path(dev),
        check_disk("disk: checkpoints", found.folder or Path.cwd()),
        check_disk("disk: hugging face cache", Path(hub_cache_dir() or hf_constants.HF_HUB_CACHE)),
        found.check,
        check_context(found, dev, memory_cap_mib=memory_cap_mib, max_ctx=max_ctx),
    ]


def passed(checks: list[Check]) -> bool:
    """True when no check failed: nothing blocks running."""
    return all(c.status != "fail" for c in checks)


def check_options(*, memory_cap_mib: float | None, device: str | None, max_ctx: int | None) -> None:
    """Raise Qat4Error, naming the flag, for an option no check can use."""
    if memory_cap_mib is not None and not (math.isfinite(memory_cap_mib) and memory_cap_mib > 0):
        raise Qat4Error(f"--memory-cap-mib is {memory_cap_mib:g}; it must be a finite positive number of MiB")
    if max_ctx is not None and max_ctx < 1:
        raise Qat4Error(f"--max-ctx is {max_ctx}; it must be at least 1 token")
    if device is not None and device not in DEVICES:
        raise Qat4Error(f"--device is {device!r}; use one of {', '.join(DEVICES)}")


# ---- versions ------------------------------------------------------------------------------------


def declared(package: str, dependency: str) -> SpecifierSet | None:
    """The versions of ``dependency`` that installed ``package`` asks for on this platform (no
    extras); None when it names none or ``package`` is not installed."""
    try:
        lines = metadata.requires(package) or []
    except metadata.PackageNotFoundError:
        return None
    for line in lines:
        req = Requirement(line)
        if req.name == dependency and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req.specifier
    return None


def requires_python() -> SpecifierSet | None:
    """qat4's Requires-Python; None when qat4 is not installed as a package."""
    try:
        return SpecifierSet(metadata.metadata("qat4")["Requires-Python"] or "")
    except metadata.PackageNotFoundError:
        return None


def version_check(name: str, version: str, wanted: SpecifierSet | None, note: str = "") -> Check:
    """ok when ``version`` is one qat4 asks for, fail when not, warn when qat4's metadata is missing."""
    if wanted is None:
        return Check(name, "warn", f"{version}{note}; qat4 is not installed as a package (pip install -e .), "
                                   "so the version it needs is unknown")
    if wanted.contains(version, prereleases=True):
        return Check(name, "ok", f"{version}{note}")
    return Check(name, "fail", f"{version}{note}; qat4 needs {name} {wanted}")


def check_python() -> Check:
    """The running Python against qat4's Requires-Python (>= 3.11)."""
    return version_check("python", platform.python_version(), requires_python())


def check_torch() -> Check:
    """torch against the version qat4 depends on, and the CUDA it was built with."""
    built = f", built with CUDA {torch.version.cuda}" if torch.version.cuda else ", a CPU build (no CUDA)"
    return version_check("torch", torch.__version__, declared("qat4", "torch"), built)


def check_triton(device: torch.device) -> Check:
    """Triton, which runs qat4's kernels: needed where qat4 launches them (CUDA, unless
    QAT4_OPS=reference), ideally the version this torch build names; elsewhere optional."""
    kernels = use_triton(torch.empty(0, device=device))
    pinned = declared("torch", "triton")  # CUDA builds of torch name the Triton they were built with
    if TRITON_VERSION is None:
        if kernels:
            wanted = f"triton{pinned}" if pinned else "triton"
            return Check("triton", "fail", f"not installed, so qat4's Triton kernels cannot run on {device.type}; "
                                           f"pip install '{wanted}', or set QAT4_OPS=reference for the slow torch "
                                           "reference ops")
        return Check("triton", "ok", f"not installed, which is fine here: qat4 runs its torch reference ops on {device.type}")
    if kernels and pinned and not pinned.contains(TRITON_VERSION, prereleases=True):
        return Check("triton", "warn", f"{TRITON_VERSION}, but torch {torch.__version__} was built with triton{pinned}; "
                                       f"if the kernels fail to compile, pip install 'triton{pinned}'")
    pair = f", the version torch {torch.__version__} was built with" if pinned else ""
    use = ("it runs qat4's kernels" if kernels
           else f"not used here: qat4 runs its torch reference ops on {device.type} (the kernel tests run Triton's interpreter)")
    return Check("triton", "ok", f"{TRITON_VERSION}{pair}; {use}")


# ---- the device and what qat4 runs on it -----------------------------------------------------------


def check_gpu(choice: str | None) -> tuple[Check, torch.device]:
    """The GPU qat4 would run on (name, compute capability, memory, tensor cores), and the device
    the other checks look at: --device as qat4 resolves it, the CPU when that is refused."""
    try:
        name = resolve_device(choice)
    except Qat4Error as exc:
        return Check("gpu", "fail", str(exc)), torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"; torch {torch.__version__} is a CPU build" if torch.version.cuda is None else ""
        return Check("gpu", "warn", "no CUDA GPU: qat4 runs on the CPU with its torch reference ops "
                                    f"(slow, for testing){build}"), torch.device("cpu")
    gpu = torch.device("cuda", torch.cuda.current_device())
    detail = describe_gpu(gpu)
    if name == "cpu":
        detail += "; --device cpu leaves it unused"
    return Check("gpu", "ok", detail), gpu if name == "cuda" else torch.device("cpu")


def describe_gpu(gpu: torch.device) -> str:
    """Name, compute capability, total and free memory, and whether qat4 finds tensor cores on it."""
    major, minor = torch.cuda.get_device_capability(gpu)
    free, total = torch.cuda.mem_get_info(gpu)
    count = torch.cuda.device_count()
    which = f" (device {gpu.index} of {count}; qat4 runs on one)" if count > 1 else ""
    cores = "tensor cores" if has_tensor_cores(gpu, torch.float16) else "no tensor cores"
    return (f"{torch.cuda.get_device_name(gpu)}{which}, sm_{major}{minor}, {total / MIB:,.0f} MiB "
            f"({free / MIB:,.0f} MiB free), {cores}")


def check_compute_path(device: torch.device) -> Check:
    """The paths qat4 takes on ``device``, as its own functions decide them: activation dtype,
    Triton kernels or torch reference ops, the prefill GEMM on tensor cores or in fp32,
    programmatic dependent launch, CUDA graphs; and which of SETTINGS are set."""
    dtype = default_dtype(device)
    probe = torch.empty(0, dtype=dtype, device=device)
    kernels = "Triton kernels" if use_triton(probe) else "torch reference ops"
    prefill = "in fp32" if prefill_uses_fp32(probe) else f"on tensor cores in {DTYPE_NAMES[dtype]}"
    pdl = "on" if pdl_launch(probe, 1)["USE_PDL"] else "off"
    graphs = "on" if uses_graphs(EngineConfig().cuda_graph, device) else "off"
    settings = [f"{key}={os.environ[key]}" for key in SETTINGS if key in os.environ]
    steered = f" (set: {', '.join(settings)})" if settings else ""
    return Check("compute path", "ok", f"{device.type}: {DTYPE_NAMES[dtype]} activations, {kernels}, prefill GEMM "
                                       f"{prefill}, PDL {pdl}, CUDA graphs {graphs}{steered}")


# ---- disk ----------------------------------------------------------------------------------------


def checkpoint_nbytes(config: Gemma4Config, packed: bool) -> int:
    """On-disk bytes of a text-only checkpoint of ``config``: every matrix 4-bit with 16-bit steps
    (``packed``: ct-emb4, Q4_0 GGUF) or 16-bit (bf16 QAT), as qat4's writers lay it out."""
    layout = text_plan(config, (lambda name: torch.float16) if packed else (lambda name: None))
    return sum(entry.nbytes for stores in layout.values() for store in stores for entry in store.entries())


def e2b_sizes() -> str:
    """The on-disk size of Gemma 4 E2B, 4-bit and 16-bit, as a phrase."""
    return (f"Gemma 4 E2B takes {checkpoint_nbytes(E2B, True) / GIB:.1f} GiB with 4-bit weights, "
            f"{checkpoint_nbytes(E2B, False) / GIB:.1f} GiB with 16-bit ones")


def nearest_existing(path: Path) -> Path:
    """``path``, or its closest ancestor that exists (what a folder yet to be made will share a disk with)."""
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk(name: str, path: Path) -> Check:
    """Free disk where ``path`` is or will be: warn under DISK_WARN_GIB, fail under DISK_FAIL_GIB."""
    where = nearest_existing(path)
    free = shutil.disk_usage(where).free
    detail = f"{free / GIB:,.1f} GiB free at {where}" + ("" if where == path.expanduser().absolute() else f" (for {path}, not made yet)")
    if free < DISK_FAIL_GIB * GIB:
        return Check(name, "fail", f"{detail}, under {DISK_FAIL_GIB} GiB; {e2b_sizes()}")
    if free < DISK_WARN_GIB * GIB:
        return Check(name, "warn", f"{detail}, under {DISK_WARN_GIB} GiB; {e2b_sizes()}")
    return Check(name, "ok", detail)


# ---- the model -----------------------------------------------------------------------------------


def inspect_model(model: str | None) -> ModelFacts:
    """--model as qat4 would find it: synthetic:PRESET, a local checkpoint, a Hub model id in the
    local cache or not yet downloaded, or none of these; never reaching the network."""
    if model is None:
        return ModelFacts(Check("model", "ok", f"none given (--model PATH|ID); the context below is {E2B_LABEL}"),
                          E2B, E2B_LABEL)
    if model.startswith(SYNTHETIC):
        try:
            config = synthetic_config(model)
        except Qat4Error as exc:
            return unusable(str(exc))
        return ModelFacts(Check("model", "ok", f"{model}: random on-grid weights built in memory, no file to read"),
                          config, f"for {model}")
    path = Path(model).expanduser()
    if path.exists():
        return local_model(model, path)
    return hub_model(model)


def local_model(model: str, path: Path, prefix: str = "") -> ModelFacts:
    """A checkpoint on this machine, opened as the loader opens it (config and headers only);
    ``prefix`` begins the detail."""
    try:
        source = open_checkpoint(path)
    except Qat4Error as exc:
        return unusable(f"--model {model}: {exc}")
    except OSError as exc:
        return unusable(f"--model {model} cannot be read ({exc.strerror or exc})")
    cfg = source.config
    detail = (f"{prefix}{source.format} checkpoint at {source.location}: {cfg.num_hidden_layers} layers, "
              f"hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size:,}")
    return ModelFacts(Check("model", "ok", detail), cfg, f"for {model}", path if path.is_dir() else path.parent)


def cached_snapshot(model_id: str, cache_dir: str | None) -> Path | None:
    """The snapshot folder of ``model_id``'s main revision in the local Hub cache (where qat4's
    loader looks first), None when it is not there."""
    try:
        cache = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return None
    for repo in cache.repos:
        if repo.repo_type == "model" and repo.repo_id == model_id:
            return next((rev.snapshot_path for rev in repo.revisions if "main" in rev.refs), None)
    return None


def hub_model(model: str) -> ModelFacts:
    """A --model that is no path here: a Hub model id in the local cache, one to be downloaded
    (with the size of a Gemma 4 E2B checkpoint), or nothing qat4 can find (fail)."""
    try:
        validate_repo_id(model)
    except HFValidationError:
        return unusable(f"--model {model}: there is no such folder or file, and it is not a Hugging Face model id "
                        "(org/name)")
    cache = hub_cache_dir()
    snapshot = cached_snapshot(model, cache)
    if snapshot is not None:
        return replace(local_model(model, snapshot, f"{model} is in the Hugging Face cache: "), folder=None)
    offline = "; HF_HUB_OFFLINE is set, so unset it for that download" if hub_offline() else ""
    detail = (f"there is no folder or file {model} here and the Hugging Face cache "
              f"({cache or hf_constants.HF_HUB_CACHE}) does not hold it: qat4 will download it from the Hub on first "
              f"use ({e2b_sizes()}){offline}")
    return ModelFacts(Check("model", "warn", detail), E2B, f"{E2B_LABEL} (--model is not on this machine yet)")


# ---- the context ---------------------------------------------------------------------------------


def shape_model(config: Gemma4Config) -> PackedModel:
    """A PackedModel of ``config`` whose tensors have shapes but no data (the meta device): what
    qat4's memory plan and byte estimates read, without weights."""

    def empty(spec: TensorSpec) -> PackedTensor | torch.Tensor:
        if not spec.packed:
            return torch.empty(spec.shape, dtype=torch.bfloat16, device="meta")
        rows, cols = spec.shape
        return PackedTensor(torch.empty(rows, cols // PER_WORD, dtype=torch.int32, device="meta"),
                            torch.empty(rows, cols // GROUP, dtype=torch.float16, device="meta"))

    return PackedModel(config, {name: empty(spec) for name, spec in expected_tensors(config).items()})


def available_ram() -> tuple[int, str]:
    """Bytes of RAM this process may still take, and where the figure comes from: MemAvailable of
    /proc/meminfo, else the free pages os.sysconf reports."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages"


def memory_budget(device: torch.device, memory_cap_mib: float | None) -> tuple[int, str]:
    """Bytes the model and its KV cache may take on ``device``, and a phrase saying whose figure it
    is: the cap, else what the GPU has free, else the RAM available. A cap off a GPU, or above what
    the GPU has, is a Qat4Error, as qat4 serve refuses it."""
    if device.type != "cuda":
        if memory_cap_mib is not None:
            raise Qat4Error(f"--memory-cap-mib applies to CUDA devices only; qat4 serve on {device.type} refuses it")
        ram, source = available_ram()
        return ram, f"RAM available ({source})"
    free, total = torch.cuda.mem_get_info(device)
    if memory_cap_mib is None:
        return free, "free on the GPU"
    if memory_cap_mib * MIB > total:
        raise Qat4Error(f"--memory-cap-mib is {memory_cap_mib:g}; the GPU has {total / MIB:,.0f} MiB")
    return int(memory_cap_mib * MIB), "under --memory-cap-mib"


def footprint(shapes: PackedModel, resolved: Plan, block_size: int) -> dict[str, int]:
    """Bytes an engine of ``resolved`` allocates, by part, from qat4's own estimates: the model, its
    KV cache, the decode working memory, and the 16-bit weight copies where the plan keeps them."""
    parts = {
        "model": model_nbytes(shapes, resolved.max_ctx, resolved.dtype),
        "KV cache": pool_nbytes(shapes.config, resolved.blocks, block_size, resolved.max_num_seqs,
                                resolved.max_ctx, resolved.dtype),
        "decode memory": decode_nbytes(shapes, resolved.max_num_seqs),
    }
    if resolved.dense:
        parts["16-bit weight copies"] = dense_nbytes(shapes.config, resolved.dtype)
    return parts


def fit(shapes: PackedModel, device: torch.device, max_ctx: int, memory_cap_mib: float | None,
        budget: tuple[int, str]) -> tuple[Plan, dict[str, int]]:
    """qat4's memory plan for one sequence of ``max_ctx`` tokens and its footprint; Qat4Error when
    it does not fit: on CUDA as the plan decides (under the cap, else in the GPU's free memory), on
    the CPU, where the plan sets no limit, when the footprint exceeds the ``budget``."""
    config = EngineConfig(max_ctx=max_ctx, max_num_seqs=1, memory_cap_mib=memory_cap_mib)
    resolved = plan(shapes, device, config)
    parts = footprint(shapes, resolved, config.block_size)
    if device.type != "cuda" and sum(parts.values()) > budget[0]:
        raise Qat4Error(f"{', '.join(f'the {k} ({v / MIB:,.0f} MiB)' for k, v in parts.items())} need "
                        f"{sum(parts.values()) / MIB:,.0f} MiB; only {budget[0] / MIB:,.0f} MiB {budget[1]}")
    return resolved, parts


@contextmanager
def memory_fraction_kept(device: torch.device) -> Iterator[None]:
    """Give this process's CUDA memory fraction on ``device`` back afterwards: the plan sets it to
    the cap when it is given one, and diagnose may run inside a process that goes on."""
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.get_per_process_memory_fraction(device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def largest_context(fits: Callable[[int], bool], top: int, step: int) -> int:
    """The largest context up to ``top`` that ``fits``: ``top`` itself, else by bisection the
    largest multiple of ``step`` below it; 0 when not even ``step`` fits."""
    if fits(top):
        return top
    lo, hi = 0, (top - 1) // step  # multiples lo * step fit (0 trivially); above hi * step is top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def check_context(found: ModelFacts, device: torch.device, *, memory_cap_mib: float | None,
                  max_ctx: int | None) -> Check:
    """The largest context (one sequence, up to the model's maximum) that fits beside the model on
    ``device``; with --max-ctx, whether that one (capped at the model's maximum, as the engine
    caps it) fits; without, whether the default one does. A --memory-cap-mib qat4 serve refuses fails."""
    shapes = shape_model(found.config)
    try:
        budget = memory_budget(device, memory_cap_mib)
    except Qat4Error as exc:
        return Check("context", "fail", str(exc))
    step = EngineConfig().block_size

    top = found.config.max_position_embeddings

    def why_not(ctx: int) -> str | None:
        """None when a context of ``ctx`` tokens fits, else why not."""
        try:
            fit(shapes, device, ctx, memory_cap_mib, budget)
        except Qat4Error as exc:
            return str(exc)
        return None

    with memory_fraction_kept(device):
        best = largest_context(lambda ctx: why_not(ctx) is None, top, step)
        if not best:
            smallest = min(step, top)
            return Check("context", "fail", f"not even {smallest} tokens fit {found.label}: {why_not(smallest)}")
        _, parts = fit(shapes, device, best, memory_cap_mib, budget)
    sizes = " + ".join(f"{k} {v / MIB:,.0f} MiB" for k, v in parts.items())
    most = " (the model's maximum)" if best == top else ""
    detail = f"up to {best:,} tokens{most} fit {found.label}: {sizes}; {budget[0] / MIB:,.0f} MiB {budget[1]}"
    if max_ctx is not None:
        asked = f"--max-ctx {max_ctx:,}" + (f" (capped at the model's maximum, {top:,})" if max_ctx > top else "")
        if min(max_ctx, top) > best:
            return Check("context", "fail", f"{asked} does not fit; {detail}")
        return Check("context", "ok", f"{asked} fits; {detail}")
    default = min(top, MAX_CTX_DEFAULT)
    if default > best:
        return Check("context", "warn", f"the default context, {default:,} tokens, does not fit: pass --max-ctx {best}; "
                                        f"{detail}")
    return Check("context", "ok", detail)
