"""The page's icon at /favicon.ico: browsers ask for it on their own, without the API key, and a 401 or 404
there shows as an error in every browser console. A small SVG (served with its own media type, which
browsers honour whatever the path's extension) keeps the package free of binary files."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

ICON_PATH = "/favicon.ico"
ICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
            '<rect width="32" height="32" rx="7" fill="#1f4e79"/>'
            '<path d="M6 20v-8M11 23V9M16 26V6M21 23V9M26 20v-8" stroke="#fff" stroke-width="2.6" '
            'stroke-linecap="round"/></svg>')

router = APIRouter()


@router.get(ICON_PATH, include_in_schema=False)
async def favicon() -> Response:
    return Response(ICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "public, max-age=86400"})
