"""azulite.spec"""
