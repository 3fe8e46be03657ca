"""Small helpers every part shares and none owns: atomic files and bounded logs (``io``,
``log_limits``), secrets kept out of output (``redact``), terminal tables (``display``), plots
(``plotting``), tensor datatype names (``dtypes``), lazy exports (``lazy``), declared-name checks
(``declarations``), the HTTP connection limits (``connections``) and the entry points' path
(``safe_path``). They import nothing of mlscale above them: any part may use them.
"""
