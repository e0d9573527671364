"""The launch wing: caller arrays (arrays), argument checks every launcher shares (checks), one call signature
compiled into a launch plan (callplan), modules per device and launches (runtime), a programmatic dependent launch
(pdl: tree_verify's combine, behind a switch), and what a launcher asks of its kernel set (protocol). Every operation's launchers (ops/<op>/launch.py) stand on it.
"""
