"""hotcold.server"""
