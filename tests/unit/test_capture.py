"""tests.capture's reader: a TCP connection's bytes put back in order from a pcap file,
and the gaps it reports (a test that claims a marker is absent relies on both)."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from tests.capture import LINKTYPE_ETHERNET, SNAPLEN, tcp_flows


def frame(src: str, sport: int, dst: str, dport: int, seq: int, payload: bytes,
          syn: bool = False) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4,
                      0x02 if syn else 0x18, 65535, 0, 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0,
                     socket.inet_aton(src), socket.inet_aton(dst)) + tcp
    return b"\0" * 12 + b"\x08\x00" + ip


def pcap(path: Path, frames: list[bytes]) -> Path:
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, SNAPLEN, LINKTYPE_ETHERNET))
        for fr in frames:
            f.write(struct.pack("<IIII", 0, 0, len(fr), len(fr)) + fr)
    return path


def test_a_connection_is_read_in_sequence_order_with_its_gaps(tmp_path: Path) -> None:
    a, b = ("10.0.0.1", 40000), ("10.0.0.2", 5555)
    isn = 2**32 - 3              # the sequence numbers wrap inside the stream
    frames = [frame(*a, *b, isn, b"", syn=True),
              frame(*a, *b, (isn + 1 + 6) % 2**32, b"MARKER"),     # out of order
              frame(*a, *b, isn + 1, b"hello "),
              frame(*a, *b, isn + 1, b"hello "),                    # a retransmission
              frame(*b, *a, 7, b"reply"),
              frame("10.0.0.3", 1, "10.0.0.4", 2, 0, b"MARKER")]    # another port
    flows = tcp_flows(pcap(tmp_path / "x.pcap", frames), 5555)
    assert set(flows) == {(a, b), (b, a)}
    assert flows[(a, b)].data() == (b"hello MARKER", 0)
    assert flows[(b, a)].data() == (b"reply", 0)
    gap = [frame(*a, *b, 100, b"", syn=True), frame(*a, *b, 101, b"abc"),
           frame(*a, *b, 110, b"xyz")]
    data, missing = tcp_flows(pcap(tmp_path / "gap.pcap", gap), 5555)[(a, b)].data()
    assert missing == 6 and data == b"abc" + b"\0" * 6 + b"xyz"
