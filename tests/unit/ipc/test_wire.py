import pytest

from deadpool_hpc.ipc import wire
from deadpool_hpc.errors import WireError


def test_roundtrip_and_tag_check():
    msg = wire.encode("decision", {"generation": 3, "members": [0, 1]}, b"s" * 32)
    assert wire.decode(msg, len(msg), b"s" * 32) == ("decision", {"generation": 3, "members": [0, 1]})
    with pytest.raises(WireError, match="secret"):
        wire.decode(msg, len(msg), b"t" * 32)


def test_tampered_and_short_messages_are_rejected():
    msg = bytearray(wire.encode("hb", {}, b"k" * 32))
    msg[2] ^= 1
    with pytest.raises(WireError):
        wire.decode(msg, len(msg), b"k" * 32)
    with pytest.raises(WireError, match="shorter"):
        wire.decode(b"abc", 3, b"k" * 32)


def test_oversized_message_is_refused():
    with pytest.raises(WireError, match="limit"):
        wire.encode("x", {"blob": "a" * (wire.MAX_MESSAGE_BYTES + 1)}, b"k" * 32)
