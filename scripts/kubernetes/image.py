"""Write a folder as a one-layer image in `docker save` form, for `ctr images import`.

    python3 image.py ROOTFS NAME:TAG ENTRYPOINT_JSON OUT.tar

scripts/start-kubernetes.sh makes the cluster's images with it: no registry is reachable
here, so the pause image and the test image are built locally. The layer is the folder as it
is (owner root, modes kept); the configuration names the entrypoint and a PATH.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile


def main() -> None:
    rootfs, name, entrypoint, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            return info

        tar.add(rootfs, arcname=".", filter=as_root)
    layer_bytes = layer.getvalue()
    layer_digest = hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
        }
    ).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        [
            {
                "Config": f"{config_digest}.json",
                "RepoTags": [name],
                "Layers": [f"{layer_digest}/layer.tar"],
            }
        ]
    ).encode()
    with tarfile.open(out, mode="w") as image:
        for path, data in (
            (f"{layer_digest}/layer.tar", layer_bytes),
            (f"{config_digest}.json", config),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            image.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
