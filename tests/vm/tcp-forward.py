#!/usr/bin/env python3
"""tcp-forward.py - TCP port forwarders for the e2e tests' network namespaces.

usage: tcp-forward.py LISTEN_ADDR:PORT=TARGET_ADDR:PORT [...]

Each mapping listens on LISTEN_ADDR:PORT and, for every accepted connection, connects to
TARGET_ADDR:PORT and copies bytes both ways until either side ends; an end on one side
(EOF or a reset) is passed on to the other at once (shutdown of writes, then close), so
a peer that dies is seen as promptly as without the forwarder. e2e-group.sh runs a
gateway in its own network namespace, reached through these from the root namespace (the
QEMU guest's user network ends in 127.0.0.1 there), so that a "network cut" (the
namespace's link taken down) stalls every connection of that gateway without resetting
any, as a real partition does. Prints "ready" once every mapping listens.
"""
import socket
import sys
import threading


def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
        try:
            s.shutdown(how)
        except OSError:
            pass


def serve(listener, target):
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=connect, args=(client, target), daemon=True).start()


def connect(client, target):
    try:
        upstream = socket.create_connection(target)
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    a = threading.Thread(target=pump, args=(client, upstream), daemon=True)
    b = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    a.start()
    b.start()
    a.join()
    b.join()
    client.close()
    upstream.close()


def endpoint(text):
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("not ADDR:PORT: %r" % text)
    return host, int(port)


def main(argv):
    if not argv or any("=" not in a for a in argv):
        sys.exit(__doc__)
    threads = []
    for mapping in argv:
        listen, target = (endpoint(p) for p in mapping.split("=", 1))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(listen)
        listener.listen(64)
        threads.append(threading.Thread(target=serve, args=(listener, target), daemon=True))
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1:])
