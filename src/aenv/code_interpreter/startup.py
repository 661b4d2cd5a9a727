"""What every Python kernel runs once started, to give results as E2B's kernels do: a formatter
that gives pandas dataframes a `data` result (a list of values per column, dates in ISO form)
beside the HTML and text pandas gives them itself, one that gives matplotlib figures a `chart`
(`charts`) beside their PNG, and one that gives lists and dicts a `json` result. Tracebacks
come without colours, and long lists' text is not cut short. A PIL image shown
(`Image.show()`) or saved to a file is also a result, its PNG, as E2B's kernels give it: no
desktop viewer opens it (the template's R brings `xdg-open`, which PIL would try first).

The code leaves no names in the user's namespace. Pandas is looked up by name (its classes
give `pandas` as their module), as are matplotlib's, so a kernel without them starts all the same.
"""

from aenv.code_interpreter.events import CHART_MIME, DATA_MIME

STARTUP_CODE = f"""
def _aenv_startup():
    import json
    import os
    import sys
    import IPython.display
    from IPython.core.formatters import BaseFormatter, JSONFormatter, catch_format_error
    from traitlets import Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode({DATA_MIME!r})
        _return_type = dict
        print_method = "_repr_aenv_data_"

    # Figures by class name, not by the type registry: matplotlib's inline backend takes
    # figures out of every formatter's registry when pyplot is imported.
    class ChartFormatter(BaseFormatter):
        format_type = Unicode({CHART_MIME!r})
        _return_type = dict

        @catch_format_error
        def __call__(self, obj):
            names = {{(c.__module__, c.__name__) for c in type(obj).__mro__}}
            if ("matplotlib.figure", "Figure") in names:
                return chart(obj)
            return None

    # Lists and dicts that JSON can hold (numpy's arrays and numbers as lists and numbers),
    # besides what IPython's gives (objects' `_repr_json_`).
    class ListsJSONFormatter(JSONFormatter):
        @catch_format_error
        def __call__(self, obj):
            if isinstance(obj, (list, dict)):
                try:
                    return json.loads(json.dumps(obj, default=plain, allow_nan=False))
                except (TypeError, ValueError):
                    pass
            return super().__call__(obj)

    def plain(value):
        if hasattr(value, "tolist"):  # numpy's arrays and scalars
            return value.tolist()
        raise TypeError(type(value).__name__)

    def frame(df):
        # A column's values as Python's: missing ones (NaN, NaT) as null, dates in ISO form,
        # what JSON cannot hold as its text.
        columns = {{
            str(name): [cell(value) for value in values]
            for name, values in df.to_dict(orient="list").items()
        }}
        return json.loads(json.dumps(columns, default=text, allow_nan=False))

    def cell(value):
        if (isinstance(value, float) and value != value) or type(value).__name__ == "NaTType":
            return None
        return value.isoformat() if hasattr(value, "isoformat") else value

    def text(value):
        try:
            return plain(value)
        except TypeError:
            return str(value)

    def chart(figure):
        # Imported on the first figure: matplotlib is slow to import, and not every kernel
        # draws.
        from aenv.code_interpreter.charts import figure_chart

        # The cell drew its figure: a chart we cannot read must not fail it.
        try:
            return figure_chart(figure)
        except Exception as e:
            print(f"aenv: no chart for this figure: {{e!r}}", file=sys.stderr)
            return None

    def images():
        try:
            from PIL import Image, ImageShow
        except ImportError:
            return
        # First in PIL's list of viewers: PIL's own one for IPython, which displays.
        ImageShow.register(ImageShow.IPythonViewer, order=-1)
        saving = Image.Image.save

        def save(image, fp, *args, **kwargs):
            if isinstance(fp, (str, os.PathLike)):
                IPython.display.display(image)
            return saving(image, fp, *args, **kwargs)

        Image.Image.save = save

    images()
    shell = get_ipython()
    shell.colors = "nocolor"
    formatters = shell.display_formatter.formatters
    formatters["text/plain"].max_seq_length = 0
    formatters["application/json"] = ListsJSONFormatter(parent=shell.display_formatter)
    formatters[{DATA_MIME!r}] = DataFormatter(parent=shell.display_formatter)
    formatters[{DATA_MIME!r}].for_type_by_name("pandas", "DataFrame", frame)
    formatters[{CHART_MIME!r}] = ChartFormatter(parent=shell.display_formatter)

_aenv_startup()
del _aenv_startup
"""
