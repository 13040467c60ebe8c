"""The image file a plot is written to: its format comes from the extension, and the file written is
exactly the path given (matplotlib alone appends ".png" to a name without an extension and raises
deep inside savefig for an extension it does not know)."""
import os

SUPPORTED = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "tif", "tiff", "webp", "eps", "ps", "gif", "avif")


def image_format(path, what="path", other=""):
    """The matplotlib format for `path` ("png" when it has no extension). Raises ValueError naming
    `what` and the formats for an extension matplotlib cannot write, or a folder. other: the
    caller's other forms, named first beside .png (e.g. "or .json for a Chrome trace")."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{what} {path}: is a folder; give a file path, e.g. {os.path.join(path, 'timeline.png')}")
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:
        return "png"
    try:
        from matplotlib.backend_bases import FigureCanvasBase
        known = set(FigureCanvasBase.get_supported_filetypes())
    except ImportError:
        known = set(SUPPORTED)
    if ext not in known:
        if other:
            raise ValueError(f"{what} {path}: '.{ext}' is not supported; use .png for an image{' ' + other} "
                             f"(other image formats: {', '.join('.' + f for f in sorted(known - {'png'}))})")
        raise ValueError(f"{what} {path}: cannot write a '.{ext}' image; use one of "
                         f"{', '.join('.' + f for f in sorted(known))} (or no extension for PNG)")
    return ext
