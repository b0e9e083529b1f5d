"""hotcold.models"""
