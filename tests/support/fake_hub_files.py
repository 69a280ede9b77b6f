"""A Hugging Face Hub on 127.0.0.1 that serves model repos for download (what
`snapshot_download` / `hf_hub_download` ask for); tests point huggingface_hub at it."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


class FakeHubFiles:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, code, payload):
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if code == 404:
                    self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                self.wfile.write(body)

            def _file(self, head: bool):
                parts = unquote(urlparse(self.path).path).strip("/").split("/")
                # /{org}/{name}/resolve/{revision}/{filename...}
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._json(404, {"error": "not found"})
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                data = hub.repos.get(repo, {}).get(name)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if repo in hub.repos else "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def do_HEAD(self):
                hub.requests.append("HEAD " + self.path)
                self._file(head=True)

            def do_GET(self):
                hub.requests.append("GET " + self.path)
                path = urlparse(self.path).path
                if path.startswith("/api/models/"):
                    rest = path[len("/api/models/") :].split("/")
                    repo = "/".join(rest[:2])
                    if repo not in hub.repos:
                        return self._json(404, {"error": "Repository not found"})
                    files = sorted(hub.repos[repo])
                    if len(rest) > 2 and rest[2] == "tree":
                        return self._json(
                            200,
                            [
                                {
                                    "type": "file",
                                    "path": f,
                                    "size": len(hub.repos[repo][f]),
                                    "oid": hashlib.sha1(hub.repos[repo][f]).hexdigest(),
                                }
                                for f in files
                            ],
                        )
                    return self._json(
                        200,
                        {
                            "id": repo,
                            "modelId": repo,
                            "sha": COMMIT,
                            "private": False,
                            "siblings": [{"rfilename": f, "size": len(hub.repos[repo][f])} for f in files],
                        },
                    )
                return self._file(head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_dir(self, repo: str, d: Path) -> None:
        self.repos[repo] = {p.name: p.read_bytes() for p in Path(d).iterdir() if p.is_file()}

    def close(self):
        self.server.shutdown()
