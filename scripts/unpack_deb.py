#!/usr/bin/env python3
"""Unpacks Debian packages into a prefix without dpkg (scripts/device_check.sh):

    python3 scripts/unpack_deb.py PREFIX pkg.deb...

A .deb is an ar archive whose data.tar.{xz,gz,zst} holds the files; usr/share is skipped."""
import io
import os
import sys
import tarfile


def members(path):
    with open(path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise SystemExit(f"{path}: not a Debian package (ar archive)")
        while True:
            head = f.read(60)
            if len(head) < 60:
                return
            name = head[:16].decode().strip().rstrip("/")
            size = int(head[48:58].decode().strip())
            data = f.read(size)
            if size % 2:
                f.read(1)
            yield name, data


def main():
    prefix, debs = sys.argv[1], sys.argv[2:]
    os.makedirs(prefix, exist_ok=True)
    n = 0
    for deb in debs:
        for name, data in members(deb):
            if not name.startswith("data.tar"):
                continue
            if name.endswith(".zst"):
                raise SystemExit(f"{deb}: zstd-compressed data is not supported here")
            with tarfile.open(fileobj=io.BytesIO(data)) as t:
                keep = [m for m in t.getmembers() if "/usr/share/" not in "/" + m.name.lstrip("./")]
                if hasattr(tarfile, "data_filter"):  # Python 3.12+, 3.11.4+
                    t.extractall(prefix, members=keep, filter="tar")
                else:
                    t.extractall(prefix, members=keep)
                n += len(keep)
    print(f"unpacked {len(debs)} packages ({n} entries) into {prefix}")


if __name__ == "__main__":
    main()
