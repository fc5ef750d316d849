"""
Helpers shared by every part of the package, imported only inside it: argument checks (``checks``), JSON-ready
values, figures and progress bars (``io``), report folders (``output_folder``), one ``save`` / ``load`` and table
formatter for reports (``report_base``), and saving and restoring what the package must not change (``state``,
``torch_utils``).
"""
