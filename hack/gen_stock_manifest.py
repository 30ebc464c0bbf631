"""Write (or check) the manifest.json of the stock forward-pass bundle.

    python hack/gen_stock_manifest.py          # rewrite engine/forward_passes/stock/manifest.json
    python hack/gen_stock_manifest.py --check  # exit 1 when the committed manifest is stale

Run it after every change to engine/forward_passes/stock/; tests/hotreload/test_bundle.py
fails while the committed manifest does not match the files.
"""

from __future__ import annotations

import argparse
import sys

from shapeshift.engine.bundle import (BundleError, compute_digest, declared_cache_format, hash_files,
                                      load_manifest, stock_bundle_dir, write_manifest)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when stale")
    args = parser.parse_args()
    folder = stock_bundle_dir()
    if args.check:
        try:
            manifest = load_manifest(folder)
        except BundleError as exc:
            print(f"stale: {exc}")
            return 1
        files = hash_files(folder)
        if (files != manifest.files or compute_digest(files) != manifest.digest
                or manifest.cache_format != declared_cache_format(folder)):
            print(f"stale: {folder}/manifest.json does not match the files; run python hack/gen_stock_manifest.py")
            return 1
        print(f"ok: stock bundle {manifest.digest}")
        return 0
    manifest = write_manifest(folder, name="stock", description="the stock forward pass shipped with the engine")
    print(f"wrote {folder}/manifest.json digest={manifest.digest} cache_format={manifest.cache_format}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
