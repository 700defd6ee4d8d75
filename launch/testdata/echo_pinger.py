"""Test job: sends `--count` messages to `--peer`, one at a time, asking for its address anew
before each (launch.discovery), and retrying one that fails until `--timeout_s`; exit 0 when
every message was echoed.

It follows a peer that restarts elsewhere (a new address under the Ray executor), and appends
each reply with the address that gave it to `--progress_file`, so a test can act mid-run and
check where the replies came from.
"""

import argparse
import socket
import sys
import time

from launch import discovery


def _ask(peer: str, message: str) -> tuple[str, str]:
  host, port = discovery.host_port_of(peer)
  with socket.create_connection((host, port), timeout=5) as conn:
    conn.sendall(message.encode())
    return conn.recv(1024).decode(), f"{host}:{port}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--peer", default="server")
  p.add_argument("--count", type=int, default=10)
  p.add_argument("--interval_s", type=float, default=0.1)
  p.add_argument("--timeout_s", type=float, default=120.0)
  p.add_argument("--progress_file", required=True)
  args = p.parse_args(argv)
  deadline = time.monotonic() + args.timeout_s
  for i in range(args.count):
    while True:
      try:
        reply, where = _ask(args.peer, f"m{i}")
        if reply:
          break
      except (OSError, discovery.DiscoveryError):
        pass
      if time.monotonic() > deadline:
        print(f"no reply to m{i} in {args.timeout_s}s", flush=True)
        return 2
      time.sleep(0.05)
    with open(args.progress_file, "a", encoding="utf-8") as f:
      f.write(f"{reply} {where}\n")
    time.sleep(args.interval_s)
  print(f"{discovery.job_name()}: {args.count} replies", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
