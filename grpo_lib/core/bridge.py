"""Split roles in one launch (one-step-off, `rollout.n_gpus_per_node` > 0): the last E processes of `accelerate launch`
run the engine, the first W - E train, and each role gets its own default process group, so everything the trainer does
over "the group" (FSDP2, checkpoints, metric reductions) involves the trainer processes only and the engine's tensor
parallelism (vLLM's external_launcher) the engine processes only. Trainer process 0 and engine process 0 talk over a
`Bridge`, a two-member process group of its own (gloo on CPU, NCCL for CUDA tensors on a GPU machine).

    launch:   W processes, ranks 0 .. W-1, one rendezvous (MASTER_ADDR:MASTER_PORT)
    trainer:  ranks 0 .. T-1      default group of T (prefix grpo-trainers), RANK / WORLD_SIZE rewritten to it
    engine:   ranks T .. W-1      default group of E (prefix grpo-engines), RANK = r - T, WORLD_SIZE = E (vLLM reads them)
    bridge:   trainer 0 <-> engine 0 (prefix grpo-bridge)

The stores: one TCP store at the launch's rendezvous, as torch's env:// opens it (the launcher's agent store when it
has one, else process 0 serves it), each group under its own prefix. Messages are pickled objects sent as byte
tensors with their length first; weights go as flat buckets of one dtype with their names and shapes sent first, so
the receiver rebuilds them without a second copy of the model. A peer that died makes the other's send / receive raise
(the socket closes) instead of waiting: the launcher then stops the rest.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from grpo_lib.core.distributed import backend_string

BRIDGE_TIMEOUT = timedelta(minutes=60)  # a receive waits this long for a peer that lives but sends nothing (a long step)


def split_role(engine_processes: int) -> str:
    """"trainer" or "engine" for this process of the launch (the last `engine_processes` ranks run the engine)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    return "engine" if rank >= world - engine_processes else "trainer"


def _launch_store():
    """The launch's rendezvous store, opened as torch's env:// rendezvous opens it."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(addr, port, world_size=world, is_master=rank == 0 and not agent, timeout=timedelta(minutes=30),
                          wait_for_workers=False)
    if agent:
        store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store


def init_split(engine_processes: int) -> tuple[str, Bridge | None]:
    """Join this process's role group (module docstring) and, on the two leaders, the bridge -> (role, bridge or None).
    Rewrites RANK / WORLD_SIZE to the role group's (the engine's vLLM and every later helper read them);
    LOCAL_RANK stays the launch's (the GPU this process owns)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    trainers = world - engine_processes
    role = split_role(engine_processes)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = _launch_store()
    own_rank, own_world = (rank, trainers) if role == "trainer" else (rank - trainers, engine_processes)
    dist.init_process_group(backend_string(cuda), store=dist.PrefixStore(f"grpo-{role}s", store), rank=own_rank,
                            world_size=own_world)
    os.environ.update(RANK=str(own_rank), WORLD_SIZE=str(own_world), GRPO_LAUNCH_RANK=str(rank))
    bridge = None
    if own_rank == 0:
        bridge = Bridge(dist.PrefixStore("grpo-bridge", store), rank=0 if role == "trainer" else 1, cuda=cuda)
    return role, bridge


class BridgeError(RuntimeError):
    """The other side of the bridge is gone (its process exited or was killed): raised instead of waiting for it."""


def _peer_gone(role: str):
    """Wrap a bridge transfer: a transport error (the peer's socket closed) becomes a BridgeError naming the peer."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except (RuntimeError, OSError) as exc:
            raise BridgeError(f"the {role} processes stopped answering ({type(exc).__name__}: {str(exc)[:200]}): "
                              f"{role} process 0 exited or was killed; its own output says why") from exc
    return guard()


class Bridge:
    """Trainer process 0 <-> engine process 0: objects and weights, in the order both sides agree on. A peer that
    is gone raises BridgeError on the next transfer, within the time its socket takes to close."""

    def __init__(self, store, *, rank: int, cuda: bool):
        self.rank, self.peer = rank, 1 - rank
        self.peer_role = "engine" if rank == 0 else "trainer"
        self.stopped = False  # the trainer side told the engine to stop
        self.cpu = dist.ProcessGroupGloo(store, rank, 2, BRIDGE_TIMEOUT)
        self.cuda = None
        nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
        if cuda and nccl is not None:  # weights travel over NCCL between the two GPUs
            self.cuda = nccl(dist.PrefixStore("nccl", store), rank, 2)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def send(self, obj) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # [n]
        with _peer_gone(self.peer_role):
            self.cpu.send([torch.tensor([data.numel()], dtype=torch.long)], self.peer, 0).wait()
            self.cpu.send([data], self.peer, 1).wait()

    def recv(self):
        size = torch.zeros(1, dtype=torch.long)
        with _peer_gone(self.peer_role):
            self.cpu.recv([size], self.peer, 0).wait()
            data = torch.empty(int(size.item()), dtype=torch.uint8)  # [n]
            self.cpu.recv([data], self.peer, 1).wait()
        return pickle.loads(data.numpy().tobytes())

    def _tensor_group(self):
        return (self.cuda, self.device) if self.cuda is not None else (self.cpu, torch.device("cpu"))

    def send_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, dtype: torch.dtype) -> int:
        """Stream (name, full tensor) pairs as flat buckets of `dtype` (at most `bucket_bytes` each, one tensor at
        least); each bucket's (names, shapes) go first. Returns the bytes sent. The receiver: `recv_weights`."""
        group, device = self._tensor_group()
        sent, bucket, size = 0, [], 0

        def flush():
            nonlocal sent
            self.send([(n, tuple(t.shape)) for n, t in bucket])
            flat = torch.cat([t.reshape(-1) for _, t in bucket])  # [sum of numels]
            with _peer_gone(self.peer_role):
                group.send([flat], self.peer, 2).wait()
            sent += flat.numel() * flat.element_size()

        for name, tensor in named:
            converted = tensor.detach().to(device=device, dtype=dtype)
            bucket.append((name, converted))
            size += converted.numel() * converted.element_size()
            if size >= bucket_bytes:
                flush()
                bucket, size = [], 0
        if bucket:
            flush()
        self.send(None)  # the end
        return sent

    def recv_weights(self, *, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """`send_weights`' pairs, bucket by bucket (a bucket's tensors are views of one buffer)."""
        group, device = self._tensor_group()
        while (layout := self.recv()) is not None:
            flat = torch.empty(sum(_numel(s) for _, s in layout), dtype=dtype, device=device)  # [sum of numels]
            with _peer_gone(self.peer_role):
                group.recv([flat], self.peer, 2).wait()
            offset = 0
            for name, shape in layout:
                n = _numel(shape)
                yield name, flat[offset:offset + n].view(shape)
                offset += n


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
