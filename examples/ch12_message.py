"""Chapter 12: one message from object to bytes and back; ZMQ's PUSH/PULL and PUB/SUB.

Also shows what is ours: a one-step `to_bytes`/`from_bytes`, N-D tensors, and a strict decoder that
names what is wrong with a malformed message instead of building whatever it was told to.
"""

import shutil
import tempfile
import threading

import msgpack
import torch

from minisgl.core import SamplingParams
from minisgl.message import BaseBackendMsg, BatchBackendMsg, MessageDecodeError, UserMsg
from minisgl.utils import ZmqPubQueue, ZmqPullQueue, ZmqPushQueue, ZmqSubQueue

msg = BatchBackendMsg(
    data=[
        UserMsg(
            uid=7,
            input_ids=torch.tensor([9707, 11, 1879], dtype=torch.int32),
            sampling_params=SamplingParams(temperature=0.6, max_tokens=64),
        ),
    ]
)
d = msg.encoder()
print("the dict encoder() produces:")
print(" ", {k: v for k, v in d.items() if k != "data"}, "data[0] =")
print("   ", dict(d["data"][0]))
raw = msgpack.packb(d, use_bin_type=True)
print(f"{len(raw)} bytes after msgpack; to_bytes() gives the same bytes: {msg.to_bytes() == raw}")
back = BaseBackendMsg.decoder(msgpack.unpackb(raw, raw=False))
print("decoded back:", back.data[0].uid, back.data[0].input_ids, back.data[0].sampling_params)

grid = UserMsg(
    uid=8, input_ids=torch.arange(6, dtype=torch.int64).reshape(2, 3), sampling_params=SamplingParams()
)
print("a 2-D tensor round trip:", BaseBackendMsg.from_bytes(grid.to_bytes()).input_ids.tolist())
for bad in (
    msgpack.packb({"__type__": "Evil"}),
    msgpack.packb({"__type__": "AbortBackendMsg", "uid": "7"}),
    raw[:40],
):
    try:
        BaseBackendMsg.from_bytes(bad)
    except MessageDecodeError as e:
        print("rejected:", e)

tmp = tempfile.mkdtemp(prefix="msgl-ex-", dir="/tmp")  # ipc paths must be short: stay under /tmp
try:
    # PUSH/PULL: a one-to-one queue; PUB/SUB: a one-to-many broadcast
    addr = f"ipc://{tmp}/pushpull"
    pull = ZmqPullQueue(addr, create=True, decoder=BaseBackendMsg.decoder)
    push = ZmqPushQueue(addr, create=False, encoder=BaseBackendMsg.encoder)
    sender = threading.Thread(
        target=lambda: [
            push.put(
                UserMsg(
                    uid=i, input_ids=torch.tensor([i], dtype=torch.int32), sampling_params=SamplingParams()
                )
            )
            for i in range(3)
        ]
    )
    sender.start()
    print("PULL received uid:", [pull.get().uid for _ in range(3)], " queue empty:", pull.empty())
    sender.join()

    paddr = f"ipc://{tmp}/pubsub"
    pub = ZmqPubQueue(paddr, create=True, encoder=BaseBackendMsg.encoder)
    subs = [ZmqSubQueue(paddr, create=False, decoder=BaseBackendMsg.decoder) for _ in range(2)]
    pub.wait_for_subscribers(2, timeout=30)  # anything published before a subscription is dropped: wait
    pub.put_raw(raw)  # rank 0 forwards the raw bytes verbatim, with no re-encoding
    print("both SUBs received it:", [s.get().data[0].uid for s in subs])
    for q in [pull, push, pub, *subs]:
        q.stop()
finally:
    shutil.rmtree(tmp, ignore_errors=True)
