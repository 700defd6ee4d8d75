"""Test job: serves `--clients` echo requests on the port the launcher reserved, then exits.

It binds the host the launcher registered for it (127.0.0.1 locally, the node's address under
Ray), so peers on other nodes reach it.
"""

import argparse
import socket
import sys

from launch import discovery


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--clients", type=int, default=1)
  p.add_argument("--prefix", default="echo")
  args = p.parse_args(argv)
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((discovery.my_host(), discovery.my_port()))
    s.listen()
    print(f"{discovery.job_name()} listening on {discovery.my_port()}", flush=True)
    for _ in range(args.clients):
      conn, _ = s.accept()
      with conn:
        msg = conn.recv(1024).decode()
        print(f"got {msg!r}", flush=True)
        conn.sendall(f"{args.prefix}:{msg}".encode())
  print("server done", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
