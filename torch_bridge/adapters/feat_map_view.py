"""`FeatMapView`: the DreamZero VAE feat map as the model uses it, a list over the session's `DenseValue`."""

from __future__ import annotations

from collections.abc import Iterator, MutableSequence
from typing import Any

from functional_state import InvalidArgumentError, SessionHandle

__all__ = ["FEAT_MAP", "FeatMapView"]

FEAT_MAP = "vae_enc_feat_map"


class FeatMapView(MutableSequence[Any]):
    """The session's VAE feat map as the model uses it: a list whose item assignments commit into the
    `DenseValue` (restored first if it was parked). Its length is fixed, as the cache's layer count is."""

    def __init__(self, handle: SessionHandle, name: str = FEAT_MAP):
        self._handle = handle
        self._name = name

    def _items(self) -> tuple[Any, ...]:
        return self._handle.get(self._name).value

    def __getitem__(self, index: Any) -> Any:
        items = self._items()
        return list(items[index]) if isinstance(index, slice) else items[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, slice):
            raise InvalidArgumentError("`vae_enc_feat_map[...] = ...`: assign items one index at a time.")
        self._handle.update(self._name, lambda cache: cache.set_item(index, value))  # type: ignore[attr-defined]

    def __delitem__(self, index: Any) -> None:
        raise InvalidArgumentError(
            "`del vae_enc_feat_map[i]`: the feat map has one entry per cached layer; assign None."
        )

    def insert(self, index: int, value: Any) -> None:
        raise InvalidArgumentError("`vae_enc_feat_map.insert`: the feat map has a fixed length; assign items instead.")

    def __len__(self) -> int:
        return len(self._items())

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items())

    def __repr__(self) -> str:
        return f"FeatMapView({len(self)} items of session {self._handle.session_id!r})"
