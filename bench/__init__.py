"""accelmig benchmarks: each prints a table with ratios against a baseline
measured in the same run, writes JSON and draws a PNG in bench/results/.

    ./dev.sh bench            # all of them
    ./dev.sh bench remoting   # one
"""
