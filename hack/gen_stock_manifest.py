"""Write (or check) the manifest.json of the stock forward-pass bundle.

    python hack/gen_stock_manifest.py          # rewrite engine/forward_passes/stock/manifest.json
    python hack/gen_stock_manifest.py --check  # exit 1 when the committed manifest is stale

Run it after every change to engine/forward_passes/stock/; tests/hotreload/test_bundle.py
fails while the committed manifest does not match the files.
"""

from __future__ import annotations

import argparse
import sys

from shapeshift.engine.forward_pass.bundle import BundleError, declared_kv, stock_bundle_dir, verify_bundle, write_manifest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when stale")
    args = parser.parse_args()
    folder = stock_bundle_dir()
    if args.check:
        try:  # every file re-hashed against the manifest, the digest against its file table
            manifest = verify_bundle(folder)
        except BundleError as exc:
            print(f"stale: {exc}; run python hack/gen_stock_manifest.py")
            return 1
        layout, cache_format = declared_kv(folder)
        if manifest.cache_format != cache_format:
            print(f"stale: {folder}/manifest.json names cache format {manifest.cache_format!r}, forward.py declares "
                  f"{cache_format!r}; run python hack/gen_stock_manifest.py")
            return 1
        if manifest.kv_layout != layout:
            print(f"stale: {folder}/manifest.json names KV layout {manifest.kv_layout!r}, forward.py declares "
                  f"{layout!r}; run python hack/gen_stock_manifest.py")
            return 1
        print(f"ok: stock bundle {manifest.digest}")
        return 0
    manifest = write_manifest(folder, name="stock", description="the stock forward pass shipped with the engine")
    print(f"wrote {folder}/manifest.json digest={manifest.digest} cache_format={manifest.cache_format}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
