"""gRPC messages read with their size checked before they are read, for both ends of the kubelet's APIs.

grpclib reads whatever length a message's prefix declares, acknowledging each part so that the peer
sends more: a peer declaring 2 GB is buffered to 2 GB. Here the 5-byte prefix (a compressed flag and a
big-endian length) is read first and a length over the limit refused, so no more than HTTP/2's
flow-control window of such a message is ever held. It reads grpclib 0.4's stream internals (the
version is pinned in constraints.txt).
"""
from __future__ import annotations

from typing import Any, Optional


class MessageTooLarge(Exception):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"a message of {length} bytes; the limit is {limit}")
        self.length = length
        self.limit = limit


class Compressed(Exception):
    def __init__(self) -> None:
        super().__init__("compressed messages are not accepted")


class Truncated(Exception):
    def __init__(self) -> None:
        super().__init__("the stream ended before the message's declared length")


async def read_message(h2_stream: Any, limit: int) -> Optional[bytes]:
    """The next message's bytes on grpclib's HTTP/2 stream (a server Stream's or client Stream's
    `_stream`), None at the stream's end. Raises MessageTooLarge before reading a message of more than
    `limit` bytes, Compressed, or Truncated."""
    try:
        prefix = await h2_stream.recv_data(5)
        if not prefix:
            return None
        if len(prefix) < 5:
            raise Truncated()
        if prefix[0]:
            raise Compressed()
        length = int.from_bytes(prefix[1:5], "big")
        if length > limit:
            raise MessageTooLarge(length, limit)
        data: bytes = await h2_stream.recv_data(length)
    except AssertionError:  # grpclib: the stream ended before the length asked for
        raise Truncated() from None
    return data


async def unary_reply(stream: Any, request: Any, limit: int) -> Optional[bytes]:
    """A unary call's one reply as bytes, on a grpclib client Stream opened by the caller (`async with
    method.open(timeout=...)`), its size checked as read_message() does; the status the server gave
    raised as grpclib raises it."""
    await stream.send_message(request, end=True)
    await stream.recv_initial_metadata()
    with stream._wrapper:  # grpclib's deadline, as its own recv_message keeps it
        return await read_message(stream._stream, limit)
