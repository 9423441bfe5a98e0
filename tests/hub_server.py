"""A local stand-in for the Hugging Face Hub, speaking the endpoints `HfApi.create_repo`, `create_branch` and
`create_commit` call (huggingface_hub 2.x), for tests that cannot reach the Hub.

Endpoints (as in huggingface_hub/hf_api.py, _commit_api.py and lfs.py):
  POST /api/repos/create                            -> {"url": ...}; 409 when the repo exists
  POST /api/models/{repo}/branch/{branch}           -> 200; 409 when the branch exists
  GET  /api/models/{repo}[/revision/{rev}]          -> minimal repo info (create_repo asks it after a 401/403)
  HEAD /{repo}/resolve/{rev}/{path}                 -> a file's metadata; 404 EntryNotFound / RepoNotFound (as the
                                                       Hub), which transformers' push_to_hub meets asking for README.md
  POST /api/validate-yaml                           -> {"errors": [], "warnings": []}
  POST /api/models/{repo}/preupload/{rev}           -> upload mode per file: "lfs" for *.safetensors, else "regular"
  POST /{repo}.git/info/lfs/objects/batch           -> basic-transfer actions: PUT to /lfs-upload/{oid}
  PUT  /lfs-upload/{oid}                            -> stores the blob (sha256 checked)
  POST /api/models/{repo}/commit/{rev}              -> NDJSON: header, then "file" (base64) and "lfsFile" lines

Large files go through LFS only when the client does not use Xet: tests set HF_HUB_DISABLE_XET=1.
`server.fail[kind] = status` makes the next requests of that kind ("create", "branch", "preupload", "lfs" (the
batch call), "lfs-upload" (the PUT), "commit", "info") answer `status` with a JSON error, as the Hub does. The server listens on 127.0.0.1 only, rejects
bodies above `max_body` bytes, serves at most `max_requests` requests, and shuts itself down after `lifetime` seconds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class HubState:
    """What the fake Hub holds: repos -> branches -> {path: bytes}, LFS blobs by sha256, commits and requests."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.blobs: dict[str, bytes] = {}
        self.commits: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.fail: dict[str, int] = {}
        self.lock = threading.Lock()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id]["branches"][branch]


class _Handler(BaseHTTPRequestHandler):
    server: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    # -- helpers ------------------------------------------------------------------------------------------------

    def _body(self) -> bytes | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.server.max_body:
            self._json(413, {"error": f"body of {length} bytes is over the test server's limit"})
            return None
        return self.rfile.read(length) if length else b""

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, kind: str) -> bool:
        status = self.server.state.fail.get(kind)
        if status is None:
            return False
        messages = {
            401: "Invalid username or password.",
            403: "You don't have the rights to create a model under this namespace",
            404: "Repository not found",
            500: "Internal Error - We're working hard to fix this as soon as possible!",
        }
        headers = {"X-Error-Message": messages.get(status, "error")}
        if status == 404:
            headers["X-Error-Code"] = "RepoNotFound"
        self._json(status, {"error": messages.get(status, "error")}, headers)
        return True

    def _count(self) -> bool:
        with self.server.state.lock:
            self.server.state.requests.append((self.command, self.path))
            over = len(self.server.state.requests) > self.server.max_requests
        if over:
            self._json(429, {"error": "the test server's request budget is spent"})
        return over

    # -- routes -------------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        if self._count():
            return
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/?]+))?(?:\?.*)?", self.path)
        if match:
            if self._fail("info"):
                return
            repo = self.server.state.repos.get(match.group(1))
            if repo is None:
                self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                return
            self._json(200, {"id": match.group(1), "sha": "0" * 40, "private": repo["private"], "siblings": []})
            return
        self._json(404, {"error": f"no route {self.path}"})

    def do_HEAD(self) -> None:
        """A file's metadata, what `hf_hub_download` asks first (transformers' push_to_hub: the existing README.md)."""
        if self._count():
            return
        match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/([^?]+)(?:\?.*)?", self.path)
        repo = self.server.state.repos.get(match.group(1)) if match else None
        if repo is None:
            self._head(404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            return
        data = repo["branches"].get(match.group(2).replace("%2F", "/"), {}).get(match.group(3))
        if data is None:
            self._head(404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"})
            return
        digest = hashlib.sha256(data).hexdigest()
        self._head(200, {"ETag": f'"{digest}"', "X-Repo-Commit": "0" * 40, "Content-Length": str(len(data))})

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        headers.setdefault("Content-Length", "0")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def do_PUT(self) -> None:
        if self._count():
            return
        match = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", self.path)
        body = self._body()
        if body is None:
            return
        if not match:
            self._json(404, {"error": f"no route {self.path}"})
            return
        if self._fail("lfs-upload"):
            return
        if hashlib.sha256(body).hexdigest() != match.group(1):
            self._json(400, {"error": "sha256 mismatch"})
            return
        with self.server.state.lock:
            self.server.state.blobs[match.group(1)] = body
        self._json(200, {})

    def do_POST(self) -> None:
        if self._count():
            return
        body = self._body()
        if body is None:
            return
        state = self.server.state
        path = self.path.split("?")[0]
        if path == "/api/repos/create":
            if self._fail("create"):
                return
            payload = json.loads(body)
            repo_id = (
                f"{payload['organization']}/{payload['name']}"
                if payload.get("organization")
                else f"user/{payload['name']}"
            )
            with state.lock:
                if repo_id in state.repos:
                    self._json(
                        409, {"error": "You already created this model repo", "url": f"{self.server.url}/{repo_id}"}
                    )
                    return
                state.repos[repo_id] = {
                    "private": payload.get("visibility") == "private" or bool(payload.get("private")),
                    "branches": {"main": {}},
                }
            self._json(200, {"url": f"{self.server.url}/{repo_id}", "name": repo_id})
            return
        if path == "/api/validate-yaml":
            self._json(200, {"errors": [], "warnings": []})
            return
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/([^/]+)", path):
            if self._fail("branch"):
                return
            repo = state.repos.get(match.group(1))
            if repo is None:
                self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            elif match.group(2) in repo["branches"]:
                self._json(409, {"error": "Reference already exists"})
            else:
                repo["branches"][match.group(2)] = dict(repo["branches"]["main"])
                self._json(200, {})
            return
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path):
            if self._fail("preupload"):
                return
            if match.group(1) not in state.repos:
                self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                return
            files = json.loads(body)["files"]
            modes = [
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                    "shouldIgnore": False,
                    "oid": None,
                }
                for f in files
            ]
            self._json(200, {"files": modes, "commitOid": "0" * 40})
            return
        if match := re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path):
            if self._fail("lfs"):
                return
            objects = json.loads(body)["objects"]
            actions = [
                {
                    "oid": o["oid"],
                    "size": o["size"],
                    "authenticated": True,
                    "actions": {"upload": {"href": f"{self.server.url}/lfs-upload/{o['oid']}"}},
                }
                for o in objects
            ]
            self._json(200, {"transfer": "basic", "objects": actions})
            return
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path):
            if self._fail("commit"):
                return
            self._commit(match.group(1), match.group(2), body)
            return
        self._json(404, {"error": f"no route {path}"})

    def _commit(self, repo_id: str, revision: str, body: bytes) -> None:
        state = self.server.state
        repo = state.repos.get(repo_id)
        if repo is None:
            self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return
        branch = revision.replace("%2F", "/")
        if branch not in repo["branches"]:
            self._json(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
            return
        header, added = None, {}
        for line in body.decode().splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                header = value
            elif item["key"] == "file":
                added[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "lfsFile":
                blob = state.blobs.get(value["oid"])
                if blob is None:
                    self._json(400, {"error": f"LFS object {value['oid']} was never uploaded"})
                    return
                added[value["path"]] = blob
        with state.lock:
            repo["branches"][branch].update(added)
            oid = hashlib.sha1(f"{len(state.commits)}".encode()).hexdigest()
            state.commits.append(
                {"repo": repo_id, "branch": branch, "header": header, "files": sorted(added), "oid": oid}
            )
        self._json(
            200, {"commitUrl": f"{self.server.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
        )


class HubServer(ThreadingHTTPServer):
    """`with HubServer() as hub:` serves on `hub.url` from a daemon thread; stops at exit or after `lifetime` s."""

    daemon_threads = True

    def __init__(self, max_body: int = 64 * 2**20, max_requests: int = 500, lifetime: float = 120.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = HubState()
        self.max_body = max_body
        self.max_requests = max_requests
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._timer = threading.Timer(lifetime, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> HubServer:
        self._thread.start()
        self._timer.start()
        return self

    def _expire(self) -> None:
        self.shutdown()
        self.server_close()

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()
        self._expire()
        self._thread.join(timeout=5)
