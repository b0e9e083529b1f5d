"""hotcold.planner"""
