"""azulite.train"""
