"""The event-stream encoder against botocore's own decoder: every frame it writes decodes, with its
CRCs checked, to the headers and payload given; a corrupted byte is caught."""

from __future__ import annotations

import pytest
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer
from hypothesis import given
from hypothesis import strategies as st

from emulator import eventstream


def decode(data: bytes) -> list[tuple[dict[str, str], bytes]]:
    buffer = EventStreamBuffer()
    buffer.add_data(data)
    return [(dict(m.headers), m.payload) for m in buffer]


@given(
    payloads=st.lists(st.binary(max_size=4096), min_size=1, max_size=5),
    split=st.integers(min_value=1, max_value=64),
)
def test_payload_parts_decode_with_botocore_whatever_the_chunking(
    payloads: list[bytes], split: int
) -> None:
    frames = b"".join(eventstream.event("PayloadPart", p) for p in payloads)
    buffer = EventStreamBuffer()
    decoded = []
    for i in range(0, len(frames), split):  # bytes arrive in arbitrary pieces
        buffer.add_data(frames[i : i + split])
        decoded += [m.payload for m in buffer]
    assert decoded == payloads


def test_an_event_carries_sagemakers_headers() -> None:
    [(headers, payload)] = decode(eventstream.event("PayloadPart", b"abc"))
    assert headers == {
        ":event-type": "PayloadPart",
        ":content-type": "application/octet-stream",
        ":message-type": "event",
    }
    assert payload == b"abc"


def test_an_exception_frame_names_its_type() -> None:
    [(headers, payload)] = decode(eventstream.exception("ModelStreamError", {"ErrorCode": "X"}))
    assert headers[":message-type"] == "exception"
    assert headers[":exception-type"] == "ModelStreamError"
    assert payload == b'{"ErrorCode": "X"}'


@pytest.mark.parametrize("at", [3, 9, 20, -2])
def test_a_corrupted_byte_fails_the_crc(at: int) -> None:
    frame = bytearray(eventstream.event("PayloadPart", b"payload"))
    frame[at] ^= 0x01
    with pytest.raises(ChecksumMismatch):
        decode(bytes(frame))
