"""Chapter 14: how two scheduler ranks receive exactly the same message sequence.

No model: only the scheduler's IO. The main process plays the tokenizer and sends 3 messages (plus
one malformed one, which rank 0 logs and drops); rank 0 pulls them from ZMQ, broadcasts each round's
count and forwards the raw bytes; rank 1 takes that many from its SUB socket.
"""

import multiprocessing as mp

import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo, destroy_process_groups, init_process_groups
from minisgl.message import BaseBackendMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import SchedulerIOMixin
from minisgl.utils import ZmqPushQueue
from minisgl.utils.host import find_free_port


class IOOnly(SchedulerIOMixin):
    def run_when_idle(self) -> None:
        pass


def rank_main(rank: int, suffix: str, port: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    tp_info = DistributedInfo(rank, 2)
    group = init_process_groups(tp_info, f"tcp://127.0.0.1:{port}", backend="gloo")
    config = SchedulerConfig(model_path="unused", tp_info=tp_info, dtype=torch.float32, _unique_suffix=suffix)
    io = IOOnly(config, group)  # rank 0 waits here until rank 1 has subscribed
    dist.barrier(group=group)
    out.put(("ready", rank))
    got: list[int] = []
    while len(got) < 3:
        got += [m.uid for m in io.receive_msg(blocking=not got)]
    out.put((rank, got))
    dist.barrier(group=group)
    io.stop_io()
    destroy_process_groups()


if __name__ == "__main__":
    mp.set_start_method("spawn")
    config = SchedulerConfig(model_path="unused", tp_info=DistributedInfo(0, 2), dtype=torch.float32)
    suffix, port = config._unique_suffix, find_free_port()
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=rank_main, args=(r, suffix, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in range(2):
            out.get(timeout=120)
        push = ZmqPushQueue(config.zmq_backend_addr, create=False, encoder=BaseBackendMsg.encoder)
        push.put(
            UserMsg(
                uid=0, input_ids=torch.tensor([1, 2], dtype=torch.int32), sampling_params=SamplingParams()
            )
        )
        push.put_raw(b"\x92not a message")  # logged by rank 0 and dropped on both ranks
        for uid in (1, 2):
            push.put(
                UserMsg(
                    uid=uid,
                    input_ids=torch.tensor([1, 2], dtype=torch.int32),
                    sampling_params=SamplingParams(),
                )
            )
        results = dict(out.get(timeout=120) for _ in range(2))
        for rank in (0, 1):
            print(f"rank {rank} received uids: {results[rank]}")
        push.stop()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        config.remove_ipc_dir()
