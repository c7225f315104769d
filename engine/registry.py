"""Registered templates that outlive the server: the router's records, one set of files per template in
a folder (`retouch serve --cache-disk-dir DIR` keeps them in DIR/templates), read back when the router
starts. The workers' disk tiers keep the recordings themselves (`retouch.cache`): a worker that joins is
asked to record each template and adopts its file instead. So a restarted server answers the templates
registered before it stopped, without the clients registering them again.

    <id>.json        {"format", "id", "size", "prompt", "steps", "seed", "guidance", "replicas", "owner",
                      "created", "negative_prompt" (only when it has one: format 2)}; written last, so a
                      template without it was not saved whole
    <id>.png         the image the workers record
    <id>.alpha.png   its transparency, when it has any (`TemplateRecord.alpha`)
    recency.json     {"format", "ids"}: the templates, most recently edited first, as the router saw them when
                     it closed; a restarted router sends a joining worker those first (`Router._most_recently_edited`)

One-off images are not kept: they are evicted by use and recorded again by their next edit anyway.
`owner` is the tenant's id, a digest of its API key (`http_api.tenant_of`), never the key.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from retouch.engine.router import TemplateRecord
from retouch.paths import lock_folder, write_whole

FORMAT = 1
# A record with a negative prompt. Releases before it read format 1 only, and skip this one (logged): read as
# format 1 it would lose its negative prompt, and its template be recorded without it under the same id.
FORMAT_NEGATIVE = 2
RECENCY = "recency.json"
TEMPLATE_ID = re.compile(r"tpl-[0-9a-f]{8,64}")
logger = logging.getLogger("retouch.registry")


class TemplateRegistry:
    """The folder of saved template records. Not thread-safe by itself: the router calls it outside its
    lock, one call per template change."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self._lock_file = lock_folder(self.directory)

    def close(self) -> None:
        self._lock_file.close()

    def save(self, record: TemplateRecord) -> None:
        """Keep `record` (a registered template); a one-off image is not kept."""
        if record.one_off or not TEMPLATE_ID.fullmatch(record.template_id):
            return
        write_whole(self._path(record.template_id, ".png"), record.image)
        if record.alpha is not None:
            write_whole(self._path(record.template_id, ".alpha.png"), record.alpha)
        header = {"format": FORMAT, "id": record.template_id, "size": list(record.size), "prompt": record.prompt,
                  "steps": record.steps, "seed": record.seed, "guidance": record.guidance,
                  "replicas": record.replicas, "owner": record.owner, "created": record.created,
                  "alpha": record.alpha is not None}
        if record.negative_prompt is not None:  # absent from the records of earlier releases, which load the same
            header |= {"format": FORMAT_NEGATIVE, "negative_prompt": record.negative_prompt}
        write_whole(self._path(record.template_id, ".json"), json.dumps(header).encode())

    def remove(self, template_id: str) -> None:
        if not TEMPLATE_ID.fullmatch(template_id):
            return
        for suffix in (".json", ".png", ".alpha.png"):  # the header first: a half-removed one is not loaded
            self._path(template_id, suffix).unlink(missing_ok=True)

    def save_recency(self, template_ids: list[str]) -> None:
        """Keep the order in which the templates were last edited, most recent first."""
        ids = [template_id for template_id in template_ids if TEMPLATE_ID.fullmatch(template_id)]
        write_whole(self.directory / RECENCY, json.dumps({"format": FORMAT, "ids": ids}).encode())

    def recency(self) -> list[str]:
        """The order `save_recency` kept, or [] (none kept, or unreadable: logged)."""
        path = self.directory / RECENCY
        if not path.exists():
            return []
        try:
            header = json.loads(path.read_bytes())
            if header["format"] != FORMAT:
                raise ValueError(f"format {header['format']}")
            return [str(template_id) for template_id in header["ids"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s cannot be read (%s): templates are taken as edited in the order they were registered",
                           path, exc)
            return []

    def load(self) -> list[TemplateRecord]:
        """Every template saved whole, oldest first; one that cannot be read is logged and skipped."""
        records = []
        for path in sorted(self.directory.glob("tpl-*.json")):
            template_id = path.name.removesuffix(".json")
            try:
                records.append(self._read(template_id))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("template %s in %s cannot be read (%s); skipped", template_id, self.directory, exc)
        return sorted(records, key=lambda record: record.created)

    def _read(self, template_id: str) -> TemplateRecord:
        if not TEMPLATE_ID.fullmatch(template_id):
            raise ValueError("not a template id")
        header = json.loads(self._path(template_id, ".json").read_bytes())
        if header["format"] not in (FORMAT, FORMAT_NEGATIVE) or header["id"] != template_id:
            raise ValueError(f"format {header['format']} of template {header['id']}")
        alpha_path = self._path(template_id, ".alpha.png")
        if header["alpha"] and not alpha_path.exists():  # its answers would lose their transparency
            raise ValueError("its transparency file is missing")
        width, height = (int(side) for side in header["size"])
        guidance, negative_prompt = header["guidance"], header.get("negative_prompt")
        return TemplateRecord(template_id, self._path(template_id, ".png").read_bytes(), (width, height),
                              str(header["prompt"]), int(header["steps"]), int(header["seed"]),
                              None if guidance is None else float(guidance), replicas=int(header["replicas"]),
                              owner=str(header["owner"]), created=float(header["created"]),
                              alpha=alpha_path.read_bytes() if header["alpha"] else None,
                              negative_prompt=None if negative_prompt is None else str(negative_prompt))

    def _path(self, template_id: str, suffix: str) -> Path:
        return self.directory / (template_id + suffix)

