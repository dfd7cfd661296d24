"""The state file's imported images (mixed into fusuma.state.db.Database)."""

from __future__ import annotations

import sqlite3

from fusuma.errors import ConflictError, NotFoundError
from fusuma.state.records import ImageRecord


class ImageTables:
    """Imported images: ``_conn`` is the Database's."""

    _conn: sqlite3.Connection

    @staticmethod
    def _image(row: sqlite3.Row) -> ImageRecord:
        return ImageRecord(name=row["name"], path=row["path"], format=row["format"],
                           virtual_size=row["virtual_size"], file_size=row["file_size"],
                           sha256=row["sha256"], source=row["source"],
                           created_at=row["created_at"])

    def images(self) -> list[ImageRecord]:
        rows = self._conn.execute("SELECT * FROM images ORDER BY name").fetchall()
        return [self._image(r) for r in rows]

    def find_imported(self, name: str) -> ImageRecord | None:
        row = self._conn.execute("SELECT * FROM images WHERE name=?", (name,)).fetchone()
        return self._image(row) if row else None

    def imported(self, name: str) -> ImageRecord:
        rec = self.find_imported(name)
        if rec is None:
            raise NotFoundError(f"no imported image named {name!r}; see `fusuma image "
                                "list`, or import one with `fusuma image import NAME FILE`.")
        return rec

    def add_image(self, img: ImageRecord) -> None:
        try:
            self._conn.execute(
                "INSERT INTO images (name, path, format, virtual_size, file_size, sha256, "
                "source, created_at) VALUES (?,?,?,?,?,?,?,?)",
                (img.name, img.path, img.format, img.virtual_size, img.file_size,
                 img.sha256, img.source, img.created_at))
        except sqlite3.IntegrityError as exc:
            raise ConflictError(f"an image named {img.name!r} already exists.") from exc

    def remove_image(self, name: str) -> None:
        self._conn.execute("DELETE FROM images WHERE name=?", (name,))

    def users_of_image(self, name: str) -> list[str]:
        """The VMs whose thin disk is an overlay of imported image ``name``."""
        rows = self._conn.execute("SELECT name FROM vms WHERE image=? AND boot!='kernel' "
                                  "ORDER BY name", (name,)).fetchall()
        return [r["name"] for r in rows]
