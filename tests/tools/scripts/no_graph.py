print("this script builds no graphc.Graph")
