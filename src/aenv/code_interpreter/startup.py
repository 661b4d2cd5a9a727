"""What every Python kernel runs once started: a formatter that gives pandas dataframes a
`data` result (their JSON in pandas' `split` layout: columns, index, rows) beside the HTML
and text pandas gives them itself, and one that gives matplotlib figures a `chart` (`charts`)
beside their PNG.

The code leaves no names in the user's namespace. Pandas is looked up by name (its classes
give `pandas` as their module), as are matplotlib's, so a kernel without them starts all the same.
"""

from aenv.code_interpreter.events import CHART_MIME, DATA_MIME

STARTUP_CODE = f"""
def _aenv_startup():
    import json
    import sys
    from IPython.core.formatters import BaseFormatter, catch_format_error
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

    def frame(df):
        return json.loads(df.to_json(orient="split", date_format="iso"))

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

    shell = get_ipython()
    formatters = shell.display_formatter.formatters
    formatters[{DATA_MIME!r}] = DataFormatter(parent=shell.display_formatter)
    formatters[{DATA_MIME!r}].for_type_by_name("pandas", "DataFrame", frame)
    formatters[{CHART_MIME!r}] = ChartFormatter(parent=shell.display_formatter)

_aenv_startup()
del _aenv_startup
"""
