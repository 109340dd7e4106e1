"""azulite.serve"""
