"""Extracts torch/include/ and torch/version.py from a torch wheel on an HTTP server without
downloading the wheel: ranged GETs read the zip's central directory and then the header
members (a few MB of a wheel of about 1 GB). Used by scripts/check-shim-headers.sh.

    python3 scripts/torch_headers.py URL DEST
"""
import io
import os
import shutil
import sys
import urllib.request
import zipfile

BLOCK = 4 << 20


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a URL, read in cached blocks with HTTP Range requests."""

    def __init__(self, url):
        self.url = url
        self.pos = 0
        self.blocks = {}
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=60) as r:
            self.size = int(r.headers["Content-Length"])
            if r.headers.get("Accept-Ranges") != "bytes":
                sys.exit(f"torch_headers: {url} does not serve byte ranges")

    def seekable(self):
        return True

    def readable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def block(self, i):
        if i not in self.blocks:
            start = i * BLOCK
            end = min(start + BLOCK, self.size) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(req, timeout=120) as r:
                self.blocks[i] = r.read()
        return self.blocks[i]

    def readinto(self, buf):
        n = min(len(buf), self.size - self.pos)
        done = 0
        while done < n:
            i, off = divmod(self.pos + done, BLOCK)
            chunk = self.block(i)[off : off + n - done]
            buf[done : done + len(chunk)] = chunk
            done += len(chunk)
        self.pos += n
        return n


def main():
    url, dest = sys.argv[1], sys.argv[2]
    f = RangeFile(url)
    with zipfile.ZipFile(io.BufferedReader(f, buffer_size=1 << 16)) as z:
        wanted = [
            m
            for m in z.infolist()
            if (m.filename.startswith("torch/include/") or m.filename == "torch/version.py")
            and not m.is_dir()
            and ".." not in m.filename.split("/")
        ]
        if not any(m.filename == "torch/version.py" for m in wanted):
            sys.exit(f"torch_headers: {url} has no torch/version.py")
        # In the order they sit in the wheel, so that the cached blocks are read once.
        for m in sorted(wanted, key=lambda m: m.header_offset):
            path = os.path.join(dest, m.filename)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(m) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    fetched = sum(len(b) for b in f.blocks.values())
    print(f"torch_headers: {len(wanted)} files into {dest}, {fetched >> 20} of {f.size >> 20} MiB fetched")


if __name__ == "__main__":
    main()
