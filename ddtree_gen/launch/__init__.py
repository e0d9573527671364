"""The launch wing: caller arrays (arrays), argument checks every launcher shares (checks), one call signature
compiled into a launch plan (callplan), modules per device and launches (runtime), and what a launcher asks of its
kernel set (protocol). Every operation's launchers (ops/<op>/launch.py) stand on it.
"""
