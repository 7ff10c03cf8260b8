"""The page template that makes `dvc plots show` and `dvc plots diff` work offline.

DVC writes `dvc_plots/index.html` with three script tags that load Vega, Vega-Lite and vega-embed from
cdn.jsdelivr.net: without a network the page is blank. DVC cannot inline them itself, but it takes a
page template (`plots.html_template` in `.dvc/config`, a path relative to `.dvc/`) in which its CDN
tags go where the template writes `{scripts}`. rlpipe's template, `.dvc/plots_page.html`, leaves that
placeholder out and inlines the same three libraries, at the versions DVC's renderer names, so the page
draws with no network, wherever it is copied.

`rlpipe plots-page` rebuilds the template from the npm registry (`npm pack`, each tarball checked
against its pinned sha512 integrity); `rlpipe plots-page --check` says whether the committed one is
what the pins give.
"""

from __future__ import annotations

import base64
import hashlib
import io
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(".dvc/plots_page.html")
"""Where the template lives in the project; `.dvc/config` names it as `plots_page.html`."""


@dataclass(frozen=True)
class Library:
    name: str
    version: str
    script: str
    """The browser build inside the npm tarball."""
    integrity: str
    """npm's sha512 integrity of the tarball."""


# The versions dvc_render's VegaRenderer loads from the CDN (tests/test_plots_page.py keeps them equal).
LIBRARIES = (
    Library("vega", "5.20.2", "package/build/vega.min.js",
            "sha512-qmH7aD9GGPpssVdxL1xgcdxTbQzyRUeRR16Os385ymvQhiwCYQNA6+eXUPAZDTVLfk0RXu6Jzj6kUE5jQ80EVw=="),
    Library("vega-lite", "5.2.0", "package/build/vega-lite.min.js",
            "sha512-Yxcg8MvYfxHcG6BbkaKT0oVCIMIcE19UvqIsEwBmyd/7h2nzW7oRnID81T8UrY7hpDrIr6wa2JADOT2dhGNErw=="),
    Library("vega-embed", "6.18.2", "package/build/vega-embed.min.js",
            "sha512-wcDyQPE4J5aiCDc3/suH5RQDvrKkjuLkhzUcbOLwEkNF8/+pp17tS0JghzEvAPNRg+5aG1/N2ydixq8Lk3dOlg=="),
)


def fetch(library: Library, workdir: Path) -> tuple[str, str]:
    """The library's browser build and its LICENSE text, from the npm tarball, integrity checked."""
    spec = f"{library.name}@{library.version}"
    done = subprocess.run(["npm", "pack", spec, "--silent", "--pack-destination", str(workdir)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"npm pack {spec} failed: {done.stderr.strip()}")
    tarball = workdir / done.stdout.strip().splitlines()[-1]
    data = tarball.read_bytes()
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if integrity != library.integrity:
        raise RuntimeError(f"{spec}: the tarball's integrity is {integrity}, not the pinned {library.integrity}")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        script = tar.extractfile(library.script).read().decode()
        licence = tar.extractfile("package/LICENSE").read().decode()
    if "</script" in script.lower():  # would end the inline <script> element early
        raise RuntimeError(f"{spec}: {library.script} contains '</script'; it cannot be inlined")
    return script, licence


def render(sources: list[tuple[Library, str, str]]) -> str:
    """The page: DVC's own layout, with the libraries inline (and their licences, as BSD-3 asks) instead of
    the `{scripts}` placeholder."""
    notices = "\n".join(f"{lib.name} {lib.version}:\n{licence.strip()}\n" for lib, _, licence in sources)
    scripts = "\n".join(f"    <script>/* {lib.name} {lib.version} */\n{script.strip()}\n    </script>"
                        for lib, script, _ in sources)
    return f"""<!DOCTYPE html>
<html>
<head>
    {{refresh_tag}}
    <meta charset="utf-8">
    <title>rlpipe: DVC plots</title>
    <!-- Written by `rlpipe plots-page` (rlpipe/plots_page.py): the libraries below are inlined so that
         this page works offline. Their licences:
{notices.replace("--", "- -")}    -->
{scripts}
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def build() -> str:
    with tempfile.TemporaryDirectory(prefix="rlpipe-plots-page-") as workdir:
        return render([(lib, *fetch(lib, Path(workdir))) for lib in LIBRARIES])


def main(root: Path, check: bool) -> int:
    """Write the template under `root` (or, with `check`, compare it with what the pins give)."""
    page, path = build(), root / TEMPLATE
    if check:
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != page:
            print(f"{path} is not what `rlpipe plots-page` writes: run it")
            return 1
        print(f"{path} is current")
        return 0
    path.write_text(page, encoding="utf-8")
    print(f"wrote {path} ({len(page.encode()) // 1024} KiB)")
    return 0
