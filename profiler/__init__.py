"""hotcold.profiler"""
