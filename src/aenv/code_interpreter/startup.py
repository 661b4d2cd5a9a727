"""What every Python kernel runs once started: a formatter that gives pandas dataframes a
`data` result (their JSON in pandas' `split` layout: columns, index, rows) beside the HTML
and text pandas gives them itself.

The code leaves no names in the user's namespace. Pandas is looked up by name (its classes
give `pandas` as their module), so a kernel without pandas starts all the same.
"""

from aenv.code_interpreter.events import DATA_MIME

STARTUP_CODE = f"""
def _aenv_startup():
    import json
    from IPython.core.formatters import BaseFormatter
    from traitlets import Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode({DATA_MIME!r})
        _return_type = dict
        print_method = "_repr_aenv_data_"

    def frame(df):
        return json.loads(df.to_json(orient="split", date_format="iso"))

    shell = get_ipython()
    formatter = DataFormatter(parent=shell.display_formatter)
    formatter.for_type_by_name("pandas", "DataFrame", frame)
    shell.display_formatter.formatters[{DATA_MIME!r}] = formatter

_aenv_startup()
del _aenv_startup
"""
