"""hotcold.executors"""
