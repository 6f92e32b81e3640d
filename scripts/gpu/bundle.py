#!/usr/bin/env python3
"""The bundle of scripts/build-gpu-bundle, on the GPU machine (scripts/test-gpu uses it).

    bundle.py unpack BUNDLE DEST   extract the manifest's executables from BUNDLE's
                                   archive (an xz-compressed tar) into DEST
    bundle.py tests BUNDLE         the test executables: "name<TAB>crate dir" lines,
                                   lantern-cuda's first
    bundle.py build-root BUNDLE    the checkout's path at build time
"""
import json
import os
import sys
import tarfile


def manifest(bundle):
    with open(os.path.join(bundle, "manifest.json")) as f:
        return json.load(f)


def unpack(bundle, dest):
    m = manifest(bundle)
    print(f"bundle: commit {m.get('commit')} (dirty: {m.get('dirty')}), "
          f"features '{m.get('features')}', built {m.get('built_at')}")
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(os.path.join(bundle, m["archive"]), "r:xz") as archive:
        for f in m["files"]:
            # Only the members the manifest names, each written to DEST under its own
            # name (never a path the archive would choose).
            target = os.path.join(dest, os.path.basename(f["name"]))
            src = archive.extractfile(f["name"])
            if src is None:
                sys.exit(f"bundle: {f['name']} is not a file of {m['archive']}")
            with src, open(target + ".part", "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.replace(target + ".part", target)
            os.chmod(target, 0o755)
            print(f"  {f['name']:<20} {os.path.getsize(target):>12} bytes  "
                  f"({f['kind']}, runs in {f['crate_dir']})")


def tests(bundle):
    files = [f for f in manifest(bundle)["files"] if f["kind"] == "test"]
    # lantern-cuda's kernels before the engine that uses them.
    for f in sorted(files, key=lambda f: (f["name"] == "engine-gpu", f["name"])):
        print(f"{f['name']}\t{f['crate_dir']}")


def main(argv):
    if len(argv) >= 2 and argv[0] == "unpack" and len(argv) == 3:
        unpack(argv[1], argv[2])
    elif len(argv) == 2 and argv[0] == "tests":
        tests(argv[1])
    elif len(argv) == 2 and argv[0] == "build-root":
        print(manifest(argv[1])["build_root"])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
