"""Test job: finds `--peer` by name, sends `--message`, prints the reply; exit 0 iff it echoed."""

import argparse
import socket
import sys
import time

from launch import discovery


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--peer", default="server")
  p.add_argument("--message", default="hello")
  p.add_argument("--expect_prefix", default="echo")
  args = p.parse_args(argv)
  host, port = discovery.host_port_of(args.peer)
  deadline = time.monotonic() + 30
  while True:  # the peer may not be listening yet
    try:
      conn = socket.create_connection((host, port), timeout=5)
      break
    except OSError:
      if time.monotonic() > deadline:
        print(f"{args.peer} at {host}:{port} never answered", flush=True)
        return 2
      time.sleep(0.05)
  with conn:
    conn.sendall(args.message.encode())
    reply = conn.recv(1024).decode()
  print(f"{discovery.job_name()} got reply {reply!r}", flush=True)
  return 0 if reply == f"{args.expect_prefix}:{args.message}" else 1


if __name__ == "__main__":
  sys.exit(main())
