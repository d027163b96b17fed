"""One ingestion end to end: download (or rewrite), repack, publish; always ends in an ``IngestEvent``.

A repository that cannot be fetched is reported once as a failed event and not retried: the failure is a fact about
the repository. Failures of kiln's own infrastructure (the blob store) raise, so the runtime retries them.
"""

from __future__ import annotations

import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from kiln.ingest.download import Git, check_location, download, is_scp_like
from kiln.ingest.errors import DownloadFailed, InvalidLocation, InvalidReference, NotFound, RewriteFailed
from kiln.ingest.policy import IngestPolicy, Vetted, shown_form, vet
from kiln.ingest.repack import repack
from kiln.ingest.rewrite import rewrite_into
from kiln.ingest.store import SaucerStore
from kiln.schemas.ingest import FailureReason, IngestEvent, IngestRequest
from kiln.streams.cancel import in_thread


async def ingest(request: IngestRequest, request_id: str, store: SaucerStore, work_root: Path, *,
                 pin: dict[str, str] | None = None, runners: int = 4,
                 policy: IngestPolicy | None = None) -> IngestEvent:
    started = time.monotonic()
    # Only the credential-free form is ever recorded, published or served.
    location = shown_form(request.location) if request.location else f"saucer:{request.root}"
    source: Vetted | None = None
    event = IngestEvent(repository=request.name, request_id=request_id, status="failed", location=location)

    def failed(reason: FailureReason, detail: str) -> IngestEvent:
        return event.model_copy(update={"reason": reason, "detail": detail[:2000],
                                        "duration_s": round(time.monotonic() - started, 3)})

    await in_thread(work_root.mkdir, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_root, prefix="ingest-") as tmp:
        repo_dir = Path(tmp) / "repo"
        try:
            if request.rewrite is not None:
                git, head = await rewrite_into(store.repository(request.rewrite.source), request.rewrite, repo_dir)
                strategy = "rewrite"
            else:
                raw = check_location(request.location or "")
                source = await in_thread(vet, raw, is_scp_like(raw), policy or IngestPolicy())
                strategy, _, head = await download(repo_dir, source, request.refs,
                                                   pin if pin is not None else request.pin, runners)
                git = Git(repo_dir, 1800)
            repacked = await repack(git, Path(tmp) / "out", head)
        except InvalidLocation as e:
            return failed("invalid_location", str(e))
        except DownloadFailed as e:
            return failed(e.reason, source.scrub(e.detail) if source else e.detail)
        except NotFound as e:
            return failed("source_missing", str(e))
        except (RewriteFailed, InvalidReference) as e:
            return failed("bad_rewrite", str(e))
        record = {"request_id": request_id, "location": location,
                  "ingested_at": datetime.now(UTC).isoformat(timespec="seconds")}
        published = await in_thread(store.publish, request.name, repacked, record)
    manifest = published.manifest
    return event.model_copy(update={
        "status": "ingested", "strategy": strategy, "refs": repacked.refs, "head": manifest.head,
        "commits": len(manifest.commits), "objects": manifest.objects, "pack_bytes": manifest.pack_bytes,
        "manifest": published.manifest_digest, "duration_s": round(time.monotonic() - started, 3),
    })
