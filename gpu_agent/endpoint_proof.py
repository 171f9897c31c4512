"""How a client of the TCP endpoint knows it talks to the agent, not to whoever bound the port first.

Any local user can listen on 127.0.0.1:9445 while the agent is down, and answer as the agent would. The
agent writes a fresh random token at each start to TOKEN_PATH, in its runtime directory (root's, 0750;
the file 0600). A client that can read it (`gpu-agent status --tcp`, as root) sends a random challenge;
the agent's answer carries HMAC-SHA256(token, challenge, SHA-256 of the body), which only a process that
read the token can make, and which binds the body to it. The token itself never crosses the connection.

Imported by `gpu-agent status`: the standard library's hmac and hashlib, and the bounded reader.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Optional

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded

TOKEN_PATH = "/run/gpu-agent/http.token"
CHALLENGE_HEADER = "x-gpu-agent-challenge"  # lower case: as the server's parser gives header names
PROOF_HEADER = "x-gpu-agent-proof"
_TOKEN_BYTES = 32
_MAX_TOKEN_FILE = 256


def new_token() -> str:
    return os.urandom(_TOKEN_BYTES).hex()


def valid_challenge(challenge: str) -> bool:
    """32 to 128 hex digits: what a client sends, and all a server signs."""
    return 32 <= len(challenge) <= 128 and all(c in "0123456789abcdef" for c in challenge)


def proof(token: str, challenge: str, body: bytes) -> str:
    message = challenge.encode("ascii") + b"\0" + hashlib.sha256(body).digest()
    return hmac.new(token.encode("ascii"), message, hashlib.sha256).hexdigest()


def proven(token: str, challenge: str, body: bytes, answer: Optional[str]) -> bool:
    return answer is not None and hmac.compare_digest(proof(token, challenge, body), answer.strip().lower())


def read_token(path: Path) -> str:
    """The token at `path`. Raises OSError (a reason to show, naming no more than the path does) when it
    cannot be read or is not a token the agent writes: a link, a FIFO, a directory, anything else."""
    try:
        data = read_bounded(path, _MAX_TOKEN_FILE, follow=False)
    except NotRegular:
        raise OSError(f"{path} is not a regular file") from None
    except TooLarge:
        raise OSError(f"{path} does not hold a token gpu-agent wrote") from None
    if data is None:
        raise OSError(f"{path} does not exist")
    token = data.decode("ascii", "replace").strip()
    if len(token) != 2 * _TOKEN_BYTES or not all(c in "0123456789abcdef" for c in token):
        raise OSError(f"{path} does not hold a token gpu-agent wrote")
    return token
